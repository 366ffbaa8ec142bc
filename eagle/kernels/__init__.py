"""Optional CPU kernels for decoding, chosen by `kernels=`: oneDNN's packed products and our
fused C++ kernels (`backends`: the settings and the switch; `fused`: the C++ kernels)."""
