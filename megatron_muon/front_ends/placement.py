"""Which parameters of a plain PyTorch (or Hugging Face) model Muon steps, and which AdamW, decided
from the module as Moonlight and Kimi decide it: the 2-D weights of hidden `nn.Linear` layers go
to Muon; embeddings, the output head, norms, biases and every other parameter go to AdamW. The
user overrides by name (fnmatch patterns); a fused attention projection (e.g. `qkv_proj`) is
orthogonalized per q/k/v block where the user names the block sizes. Pure: no communication."""

import fnmatch
from dataclasses import dataclass

import torch

# Names the output head goes by (Hugging Face's `lm_head`, Megatron's `output_layer`).
HEAD_NAMES = ("lm_head", "output_layer", "output")


@dataclass(frozen=True)
class Placement:
    """Parameter names, in the model's order: those Muon steps, those AdamW steps, and each fused
    projection's q/k/v rows per query group."""
    muon: tuple[str, ...]
    adamw: tuple[str, ...]
    qkv_splits: dict[str, tuple[int, ...]]

    def describe(self) -> list[str]:
        """The lines said at start: every parameter and where it went."""
        split = {name: f" (q/k/v rows per group {list(rows)})" for name, rows in self.qkv_splits.items()}
        return ([f"Muon ({len(self.muon)}): " + ", ".join(n + split.get(n, "") for n in self.muon),
                 f"AdamW ({len(self.adamw)}): " + ", ".join(self.adamw)])


def _heads(module: torch.nn.Module) -> set[str]:
    """Weights of the output head: a Linear named like one, one sharing its weight with an
    embedding (tied), or the one a Hugging Face model names (`get_output_embeddings`)."""
    tied = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    named_by_model = getattr(module, "get_output_embeddings", lambda: None)()
    return {f"{name}.weight" if name else "weight" for name, child in module.named_modules()
            if isinstance(child, torch.nn.Linear) and (
                name.rpartition(".")[2] in HEAD_NAMES or id(child.weight) in tied
                or child is named_by_model)}


def _hidden_linear_weights(module: torch.nn.Module) -> set[str]:
    return {f"{name}.weight" if name else "weight" for name, child in module.named_modules()
            if isinstance(child, torch.nn.Linear)}


def _matching(names, patterns, what: str) -> list[str]:
    """The names any pattern matches, in the model's order; a pattern that matches none is
    refused."""
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ValueError(f"{what} pattern {pattern!r} matches no parameter of the model")
    return [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def place(module: torch.nn.Module, muon: tuple[str, ...] = (), adamw: tuple[str, ...] = (),
          qkv_splits: dict[str, tuple[int, ...]] | None = None) -> Placement:
    """Where each trainable parameter of `module` goes. `muon` and `adamw`: fnmatch patterns of
    parameter names that override the rule (a name both match is refused); `qkv_splits`: {pattern:
    (q, k, v rows per query group)} for fused projections, which Muon then orthogonalizes per
    block. Raises ValueError naming the parameter for what Muon cannot step: a parameter sent to
    Muon that is not 2-D, a split that does not tile its rows, a pattern that matches nothing."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    names = [name for name, _ in named]
    forced_muon = set(_matching(names, muon, "muon"))
    forced_adamw = set(_matching(names, adamw, "adamw"))
    both = [name for name in names if name in forced_muon and name in forced_adamw]
    if both:
        raise ValueError(f"{both[0]} matches both a muon and an adamw pattern: choose one")
    by_rule = _hidden_linear_weights(module) - _heads(module)
    to_muon = [name for name in names
               if name in forced_muon or (name in by_rule and name not in forced_adamw)]
    shapes = dict(named)
    for name in to_muon:
        if shapes[name].dim() != 2:
            raise ValueError(f"{name} (shape {tuple(shapes[name].shape)}) goes to Muon but is not "
                             "a 2-D matrix: Muon orthogonalizes matrices; send it to AdamW")
    splits = {}
    for pattern, rows in (qkv_splits or {}).items():
        for name in _matching(to_muon, (pattern,), "qkv_splits"):
            if shapes[name].shape[0] % sum(rows):
                raise ValueError(f"{name} has {shapes[name].shape[0]} rows, not whole q/k/v "
                                 f"groups of {list(rows)} rows")
            splits[name] = tuple(rows)
    muon_names = set(to_muon)
    return Placement(tuple(to_muon), tuple(n for n in names if n not in muon_names), splits)
