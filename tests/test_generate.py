"""Generation (eagle/bench/generate.py, decode.py's default mode): one prompt streamed, or
several decoded at once, each block tagged with its prompt."""

from __future__ import annotations

from helpers.configs import decode_cfg


def test_generate_mode_streams(models, tmp_path, capsys):
    from decode import decode

    decode(decode_cfg(models, tmp_path, "method=vanilla", "prompt='def f(x):'"))
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and "tokens/s" in out and "tau" in out
    assert "LOSSY" not in out
    decode(decode_cfg(models, tmp_path, "method=medusa_typical", "temperature=1.0"))
    assert "[medusa_typical, float32, LOSSY (typical acceptance)]" in capsys.readouterr().out
    decode(decode_cfg(models, tmp_path, "method=medusa", "temperature=1.0"))
    assert "LOSSY" not in capsys.readouterr().out


def test_generate_decodes_several_prompts_at_once(models, tmp_path, capsys):
    from decode import decode

    decode(decode_cfg(models, tmp_path, "method=eagle", "prompts=['def f(x):','class A:']"))
    out = capsys.readouterr().out
    assert "[0] " in out and "[1] " in out and "2 sequences at once" in out


def test_generate_runs_from_the_library_without_the_config(models, capsys):
    """What the default mode calls, on plain settings: a notebook's or a script's way in."""
    from eagle.bench.builder import Methods
    from eagle.bench.generate import generate
    from eagle.sampling import SamplingPolicy
    from helpers.models import TREES

    methods = Methods({"eagle": {"random": True}}, target=models / "target", device="cpu",
                      tree_dir=TREES, kernels="default")
    generate(methods, "eagle@chain5", "def f(x):", SamplingPolicy(), 8, dtype="float32")
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and "[eagle@chain5, float32] " in out and "tau" in out
