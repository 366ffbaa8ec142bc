"""Optional CPU kernels for decoding: one backend behind the target runner, chosen by `kernels=`.

A decoding step multiplies one row (a verification: a tree's few rows) by every weight of the
target, so it is bound by reading the weights, and cannot beat reading them once
(`eagle.bench.floor`). PyTorch's own kernels run such steps well above that floor on a CPU:
MKL's few-row products read their weights far below the memory's speed on some CPUs, and the
small operations and Python between the products (norms, rotary embedding, SwiGLU, residuals,
the cache's writes) add a large share of a small model's step. The settings:

  "default"         `F.linear` and the model's own forward: plain PyTorch, no backend;
  "onednn"          oneDNN's inner product on weights packed once (`onednn`), float32;
  "fused"           our C++ kernels (`fused`, `csrc/fused.cpp`): packed products and whole
                    decoder layers in two calls each, float32, bitwise batch-invariant;
  "fused_prefetch"  the same, each product also asking for its weights ahead in software
                    (faster on some CPUs, slower on others);
  "auto"            (decode.py) the one that decodes fastest on this target here, measured at
                    load (`eagle.bench.precision.faster_kernels`).

Measured figures: docs/performance.md. The decoding runtime never imports this package: each
linear a setting switches carries the setting's backend object (`backends`), and the runtime
talks to it through `eagle.decoding.backend`. A packed product rounds differently from
`F.linear`, so exactness holds against the target on the same kernels: a run applies one
setting to every method alike, vanilla decoding included.
"""

from eagle.kernels.backends import (
    BACKENDS,
    FUSED,
    KERNELS,
    available_kernels,
    check_kernels,
    free_memory_bytes,
    use_kernels,
)
from eagle.kernels.onednn import PACKED_DTYPES, packed_bytes

__all__ = ["BACKENDS", "FUSED", "KERNELS", "PACKED_DTYPES", "available_kernels", "check_kernels",
           "free_memory_bytes", "packed_bytes", "use_kernels"]
