"""The model and data of ``dcp-tiered train``: a small GPT-style transformer, synthetic token
batches that depend only on the seed and the step, and a bit-for-bit state comparison."""

from __future__ import annotations

import os
from typing import Any

from dcp_tiered.cli.output import CliError, human_bytes


def build_model(vocab: int, seq_len: int, d_model: int, layers: int, heads: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Embedding(seq_len, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), diagonal=1)
            for b in self.blocks:
                x = b(x, mask)
            return self.head(self.ln_f(x))

    return TinyGPT()


def batch_for_step(step: int, seed: int, batch: int, seq_len: int, vocab: int, device: Any) -> Any:
    """Synthetic arithmetic sequences; the batch depends only on ``seed`` and ``step``."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    a = torch.randint(0, vocab, (batch, 1), generator=g)
    b = torch.randint(1, 8, (batch, 1), generator=g)
    t = torch.arange(seq_len + 1).unsqueeze(0)
    return ((a + b * t) % vocab).to(device)


def flat_tensors(sd: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists flattened to ``{"a.0.b": leaf}``."""
    out: dict[str, Any] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out.update(flat_tensors(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = sd
    return out


def compare_states(saved: Any, live: Any) -> tuple[list[str], int, int]:
    """Bit-for-bit comparison: (differences, tensors compared, bytes compared)."""
    import torch

    a, b = flat_tensors(saved), flat_tensors(live)
    diffs = [f"missing in restored state: {k}" for k in sorted(set(a) - set(b))]
    diffs += [f"extra in restored state: {k}" for k in sorted(set(b) - set(a))]
    n = nbytes = 0
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            n += 1
            nbytes += x.numel() * x.element_size()
            x, y = x.detach().cpu().contiguous(), y.detach().cpu().contiguous()
            if x.dtype != y.dtype or x.shape != y.shape:
                diffs.append(f"{k}: {x.dtype}{tuple(x.shape)} != {y.dtype}{tuple(y.shape)}")
            elif x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                diffs.append(f"{k}: values differ")
        elif isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor) or x != y:
            diffs.append(f"{k}: {x!r} != {y!r}")
    return diffs, n, nbytes


def fp32_bytes(sd: Any) -> int:
    """Bytes of the state's tensors with floating ones counted as fp32."""
    import torch

    return sum(v.numel() * (4 if v.is_floating_point() else v.element_size())
               for v in flat_tensors(sd).values() if isinstance(v, torch.Tensor))


def check_resume(dump_dir: str, step: int, model: Any, optim: Any) -> dict[str, Any]:
    """``--check-resume``: compare the restored model and optimizer with the state dumped at ``step``."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = os.path.join(dump_dir, f"step_{step:09d}.pt")
    if not os.path.exists(path):
        raise CliError(f"--check-resume: no saved state for step {step} in {dump_dir}", 3)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    msd, osd = get_state_dict(model, optim)
    diffs, n, nbytes = compare_states(saved, {"model": msd, "optim": osd})
    if diffs:
        print(f"resume check: FAILED, restored state differs from the state saved at step {step}: "
              + "; ".join(diffs[:5]), flush=True)
    else:
        print(f"resume check: restored state equals the state saved at step {step} bit for bit "
              f"({n} tensors, {human_bytes(nbytes)}, model and optimizer)", flush=True)
    return {"step": step, "equal": not diffs, "tensors": n, "bytes": nbytes, "differences": diffs[:20]}
