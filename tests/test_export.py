"""The export mode (decode.py mode=export, eagle.models.export.export_formats): one folder per
format that can hold the drafter. The formats themselves are tested in tests/test_checkpoint.py."""

from __future__ import annotations

import pytest

from eagle.target import load_target
from helpers.configs import decode_cfg


def test_export_mode_writes_one_folder_per_format(models, tmp_path, monkeypatch, capsys):
    """`decode.py mode=export`: by default every format that can hold the drafter is written,
    and the others are named with the reason (vLLM's loader has no fc bias: a drafter trained
    with one is skipped for it); a format asked for by name that cannot hold it is refused, by
    name, after the others are written. Only the target's embeddings and LM head are read."""
    import eagle.models.export as export_module
    from decode import decode
    from eagle.models.checkpoint import save_drafter
    from eagle.models.drafter import DrafterConfig, EagleDrafter
    from eagle.models.export import ExportError, import_eagle

    loads = []
    monkeypatch.setattr(export_module, "load_target",
                        lambda *a, **kw: loads.append(kw) or load_target(*a, **kw))
    target, tokenizer = load_target(models / "target")
    for bias in (False, True):
        config = DrafterConfig.from_target(target, tokenizer).to_dict()
        config = DrafterConfig.from_dict({**config, "fc_bias": bias})
        drafter = save_drafter(EagleDrafter.on_target(config, target),
                               tmp_path / f"drafter_bias{bias}")
        out = tmp_path / f"export_bias{bias}"
        decode(decode_cfg(models, tmp_path, "mode=export", f"eagle.drafter={drafter}",
                          f"export.out_dir={out}"))
        want = ["eagle", "sglang"] if bias else ["eagle", "sglang", "vllm"]
        assert sorted(p.name for p in out.iterdir()) == want
        skipped = "[export] vllm: skipped: vLLM's EAGLE loader builds fc without a bias"
        assert (skipped in capsys.readouterr().out) == bias
        for fmt in (p.name for p in out.iterdir()):
            back = import_eagle(out / fmt, target, tokenizer)
            # SGLang's fc always has one
            assert (back.fc.bias is not None) == (bias or fmt == "sglang")
    named = decode_cfg(models, tmp_path, "mode=export", f"eagle.drafter={drafter}",
                       "export.formats=[vllm,sglang]", f"export.out_dir={tmp_path / 'named'}")
    with pytest.raises(ExportError, match="vllm: .*fc_bias"):
        decode(named)
    assert sorted(p.name for p in (tmp_path / "named").iterdir()) == ["sglang"]
    assert loads and all(kw.get("weights") == "head" for kw in loads)
