"""Write an AWQ or GPTQ checkpoint folder from a plain safetensors one by round-to-nearest
quantisation (`rtn.py`) of every decoder linear layer, in the on-disk layouts of
`int_layouts.py`, with the `quantization_config` AutoAWQ and GPTQModel write. The tests and the
accuracy benchmark build their integer checkpoints with it (none can be downloaded); no
calibration, so its accuracy is RTN's, a lower bound for real AWQ/GPTQ checkpoints.

GPTQ's act-order (`desc_act`) quantises the inputs in the order of its Hessian's diagonal;
without calibration data this writer draws that order at random per layer input (shared by the
layers that read the same input, as GPTQ's would be), which exercises the same layout.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.executor.quant.int_layouts import awq_tensors, gptq_tensors
from kvpilot.runtime.executor.quant.rtn import RtnWeight, rtn_quantize

LINEAR = re.compile(r"(.*layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj)\.weight")
# layers that read the same input share one act-order permutation
SHARED_INPUT = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "o_in", "gate": "mlp_in", "up": "mlp_in",
                "down": "down_in"}


@dataclass(frozen=True)
class IntFormat:
    method: str  # awq | gptq
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False  # GPTQ's sym (AWQ is always asymmetric)
    desc_act: bool = False  # GPTQ's act-order
    checkpoint_format: str = "gptq"  # GPTQ: gptq (zero - 1 stored) or gptq_v2

    def __post_init__(self) -> None:
        if self.method not in ("awq", "gptq"):
            raise ValueError(f"method must be awq or gptq, not {self.method!r}")
        if self.method == "awq" and (self.bits != 4 or self.symmetric or self.desc_act):
            raise ValueError("AWQ checkpoints are 4-bit, asymmetric, without act-order")
        if self.checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint_format must be gptq or gptq_v2, not {self.checkpoint_format!r}")

    def quantization_config(self) -> dict[str, Any]:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.desc_act, "sym": self.symmetric, "true_sequential": True,
                "checkpoint_format": self.checkpoint_format}

    def tensors(self, weight: torch.Tensor, perm: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One (N, K) weight's tensors in this format (`perm`: act-order's input order)."""
        if self.method == "awq":
            return awq_tensors(rtn_quantize(weight, 4, self.group_size, symmetric=False))
        ordered = weight if perm is None else weight[:, perm]
        rtn = rtn_quantize(ordered, self.bits, self.group_size, self.symmetric)
        q = rtn.q
        if perm is not None:
            q = torch.empty_like(rtn.q)
            q[:, perm] = rtn.q
        offset = 1 if self.checkpoint_format == "gptq" else 0
        return gptq_tensors(RtnWeight(q, rtn.scales, rtn.zeros), self.bits, offset, perm)


def write_int_checkpoint(src: Path, dst: Path, fmt: IntFormat, seed: int = 0) -> None:
    """Quantise the plain checkpoint folder `src` into `dst` (created); every other tensor and
    file is copied as it is."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy2(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config()
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensor = f.get_tensor(name)
                match = LINEAR.fullmatch(name)
                if match is None:
                    out[name] = tensor  # norms, embeddings, the LM head: as they are
                    continue
                perm = None
                if fmt.desc_act:
                    key = (match.group(2), SHARED_INPUT[match.group(4)])
                    perm = perms.setdefault(key, torch.randperm(tensor.shape[1], generator=gen))
                for kind, t in fmt.tensors(tensor.float(), perm).items():
                    out[f"{match.group(1)}.{kind}"] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
