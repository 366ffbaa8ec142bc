"""Medusa-1 heads (Cai et al. 2024): K extra next-next-token heads on a frozen target.

All K heads read the same tensor, the target's feature f_t (the last hidden state, the one
that feeds the LM head, `eagle.target.target_forward(...).features`). The LM head predicts
x_{t+1} from it; head k (k = 1..K) predicts x_{t+k+1}:

    h_k    = f_t + SiLU(W1_k f_t + b1_k)     residual block; W1 zero-initialised (Medusa)
    logits = W2_k h_k                        Linear(H, V), initialised from the LM head

so an untrained head starts as (almost) the LM head itself, its logits taking the target's own
transform (Cohere's scale, Gemma-2's soft-cap). The K heads are K separately
constructed modules in an `nn.ModuleList`: `[head] * K` would train one module K times
(a bug Medusa's users hit), and `MedusaHeads` refuses heads that share parameters.

Decoding: `eagle.proposers.medusa` fills a sparse tree from the heads' top-k; training:
`eagle.training.medusa`; checkpoints: `eagle.models.checkpoint.save_medusa` / `load_medusa`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle.target import LogitTransform, TargetIdentity, check_shape, lm_head


class MedusaError(ValueError):
    """Medusa heads that cannot be used as asked (shared heads, a tree too deep for them)."""


@dataclass
class MedusaConfig:
    """Shape of a set of Medusa heads and the identity of the target they were trained for.

    Attributes:
        num_heads: K; head k predicts the token k + 1 positions after the LM head's.
        hidden_size, vocab_size: the target's H and V.
        num_layers: residual blocks per head (Medusa-1: 1).
        target: `eagle.target.TargetIdentity(...).to_dict()` of the target.
        draft_vocab: the token ids the heads were trained over (a reduced loss vocabulary) and
            draft from; None = the whole vocabulary.
        logit_scale, logit_softcap: the target's `eagle.target.LogitTransform`, applied to every
            head's logits as the target applies it to its LM head's (Cohere's scale, Gemma-2's
            soft-cap), so that an untrained head is the target's own next-token distribution.
    """

    num_heads: int
    hidden_size: int
    vocab_size: int
    num_layers: int = 1
    target: dict = field(default_factory=dict)
    draft_vocab: list[int] | None = None
    logit_scale: float = 1.0
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "hidden_size", "vocab_size", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"medusa config: {name} must be a positive integer, got {value!r}")
        check_shape(
            "medusa config", self.target, hidden_size=self.hidden_size, vocab_size=self.vocab_size
        )
        if self.draft_vocab is not None:
            ids = [int(t) for t in self.draft_vocab]
            if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(
                    f"medusa config: draft_vocab must be 1..{self.vocab_size} distinct token ids "
                    "in "
                    f"[0, {self.vocab_size})"
                )
            self.draft_vocab = ids

    @classmethod
    def from_target(
        cls,
        model: nn.Module,
        num_heads: int,
        num_layers: int = 1,
        tokenizer=None,
        path: str | None = None,
    ) -> MedusaConfig:
        ident, transform = (
            TargetIdentity.of(model, tokenizer, path),
            LogitTransform.of(model.config),
        )
        return cls(
            num_heads=num_heads,
            hidden_size=ident.hidden_size,
            vocab_size=ident.vocab_size,
            num_layers=num_layers,
            target=ident.to_dict(),
            logit_scale=transform.scale,
            logit_softcap=transform.softcap,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MedusaConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"medusa config: unknown keys {unknown}")
        return cls(**data)


class ResBlock(nn.Module):
    """h + SiLU(W1 h + b1), with W1 zero-initialised so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.linear.weight)  # Medusa: zero W1; the bias keeps PyTorch's init
        self.act = nn.SiLU()

    def forward(self, h: Tensor) -> Tensor:
        return h + self.act(self.linear(h))  # (..., H)


class MedusaHead(nn.Module):
    """One head: `num_layers` residual blocks, then a projection to the vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int = 1):
        super().__init__()
        self.blocks = nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))
        self.proj = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(self.blocks(features))  # (..., H) -> (..., V)


def shared_parameters(modules: Sequence[nn.Module]) -> tuple[int, int] | None:
    """The first pair (i, j) of modules that share a parameter's storage, or None."""
    owners: dict[int, int] = {}
    for i, m in enumerate(modules):
        for p in m.parameters():
            j = owners.setdefault(p.untyped_storage().data_ptr(), i)
            if j != i:
                return j, i
    return None


class MedusaHeads(nn.Module):
    """K distinct Medusa heads.

    Args:
        config: the heads' shape and target identity.
        heads: optional prebuilt heads (K of them, all distinct); by default K fresh heads.
            Heads that share parameters (`[head] * K`) are refused.
    """

    def __init__(self, config: MedusaConfig, heads: Sequence[MedusaHead] | None = None):
        super().__init__()
        self.config = config
        if heads is None:
            heads = [
                MedusaHead(config.hidden_size, config.vocab_size, config.num_layers)
                for _ in range(config.num_heads)
            ]  # K constructor calls: K modules
        heads = list(heads)
        if len(heads) != config.num_heads:
            raise MedusaError(f"medusa config says {config.num_heads} heads, got {len(heads)}")
        shared = shared_parameters(heads)
        if shared is not None:
            raise MedusaError(
                f"Medusa heads {shared[0]} and {shared[1]} share parameters (a list built "
                f"as [head] * K?): each head must be its own module"
            )
        self.heads = nn.ModuleList(heads)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, features: Tensor) -> Tensor:
        """Logits of every head: (..., H) -> (K, ..., V); entry k-1 is head k's, x_{t+k+1}.
        With a drafting vocabulary only its rows are computed, and every other token's logit is
        -inf (the heads were never trained on them: their rows are still the LM head's)."""
        features = features.to(self.device, self.dtype)
        if self.config.draft_vocab is None:
            return self.transform(torch.stack([head(features) for head in self.heads]))
        return self.to_vocab(self.drafted(features))

    @property
    def transform(self) -> LogitTransform:
        """The target's logit transform, which every head's logits take as its LM head's do."""
        return LogitTransform(scale=self.config.logit_scale, softcap=self.config.logit_softcap)

    def drafted(self, features: Tensor) -> Tensor:
        """Every head over its drafting vocabulary's rows only: (..., H) -> (K, ..., V_draft)."""
        features = features.to(self.device, self.dtype)
        return self.transform(
            torch.stack(
                [
                    F.linear(head.blocks(features), rows)
                    for head, rows in zip(self.heads, self._rows())
                ]
            )
        )

    def _rows(self) -> list[Tensor]:
        """Each head's projection rows of the drafting vocabulary (V_draft, H). Training takes
        them afresh (their gradient flows back); decoding and validation reuse one copy per
        version of the weights, so a round does not copy K x V_draft x H floats again."""
        ids = self.vocab_ids()
        weights = [head.proj.weight for head in self.heads]
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            return [w.index_select(0, ids) for w in weights]
        key = tuple(
            (w.data_ptr(), w._version, w.dtype) for w in weights
        )  # an optimizer step bumps _version
        cached = getattr(self, "_cached_rows", None)
        if cached is None or cached[0] != key:
            cached = self._cached_rows = (key, [w.index_select(0, ids) for w in weights])
        return cached[1]

    def to_vocab(self, drafted: Tensor) -> Tensor:
        """Logits over the drafting vocabulary (K, ..., V_draft) as logits over every token
        (K, ..., V), -inf off it; in `drafted`'s dtype (under autocast, the autocast one)."""
        out = drafted.new_full((*drafted.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.vocab_ids()] = drafted
        return out

    def vocab_ids(self) -> Tensor:
        """The drafting vocabulary's ids (V_draft,) on the heads' device (a config without one: an
        error)."""
        if self.config.draft_vocab is None:
            raise MedusaError("these Medusa heads draft from the whole vocabulary (no draft_vocab)")
        ids = getattr(self, "_vocab_ids", None)
        if ids is None or ids.device != self.device or ids.numel() != len(self.config.draft_vocab):
            ids = self._vocab_ids = torch.tensor(
                self.config.draft_vocab, dtype=torch.long, device=self.device
            )
        return ids

    def restrict_vocab(self, ids: Tensor | None) -> None:
        """Draft from the tokens `ids` (V_draft,) only, or from every token again (None); saved with
        the heads (their config's `draft_vocab`)."""
        self.config.draft_vocab = (
            None if ids is None else [int(t) for t in torch.as_tensor(ids).flatten()]
        )
        self.config.__post_init__()
        self._vocab_ids = self._cached_rows = None

    @torch.no_grad()
    def init_from_lm_head(self, model: nn.Module) -> MedusaHeads:
        """Copy the target's LM head into every head's projection (Medusa's initialisation)."""
        w = lm_head(model).weight  # (V, H)
        for head in self.heads:
            head.proj.weight.copy_(w.to(head.proj.weight.dtype))
        return self

    @classmethod
    def for_target(
        cls,
        model: nn.Module,
        num_heads: int,
        num_layers: int = 1,
        tokenizer=None,
        path: str | None = None,
        seed: int = 0,
    ) -> MedusaHeads:
        """Fresh heads for `model` as Medusa initialises them (zero W1, the LM head's W2),
        in fp32 (training keeps fp32 weights)."""
        config = MedusaConfig.from_target(model, num_heads, num_layers, tokenizer, path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            heads = cls(config)
        return heads.to(lm_head(model).weight.device).init_from_lm_head(model)

    @classmethod
    def random(
        cls,
        model: nn.Module,
        num_heads: int,
        tokenizer=None,
        path: str | None = None,
        seed: int = 0,
        scale: float = 1.0,
    ) -> MedusaHeads:
        """Untrained heads with random W1 (N(0, scale^2 / H)), so that every head differs from
        the LM head and from the others; on the target's device and dtype. For checking
        losslessness before any training; never a silent fallback for a missing checkpoint."""
        heads = cls.for_target(model, num_heads, tokenizer=tokenizer, path=path, seed=seed)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for block in itertools.chain.from_iterable(h.blocks for h in heads.heads):
                w = block.linear.weight
                w.copy_(torch.randn(w.shape, generator=g) * scale / w.shape[1] ** 0.5)
        p = next(model.parameters())
        return heads.to(p.device, p.dtype)
