"""`flashnext flops`: per-component FLOPs of a packed batch, and a named error for bad lengths."""

from flashnext.cli import main
from flashnext.config import parse_config, tiny_config
from flashnext.flops import count_flops


def test_flops_prints_every_component(capsys):
    assert main(["flops", "--seq-lens", "40,3,1"]) == 0
    out = capsys.readouterr().out
    assert "44 tokens" in out
    for name in ("gdn", "qsa_indexer", "qsa_attention", "moe_routed", "lm_head", "total"):
        assert f"  {name} " in out, name
    import json
    from importlib import resources

    cfg = parse_config(json.loads(resources.files("flashnext").joinpath("configs/tiny.json").read_text())).text
    total = count_flops(cfg, [40, 3, 1])["total"]
    assert f"{total / 1e9:12.4f} G" in out


def test_flops_rejects_bad_lengths(capsys):
    assert main(["flops", "--seq-lens", "4,x"]) == 1
    assert "--seq-lens" in capsys.readouterr().err


def test_flops_reads_a_run_config(tmp_path, capsys):
    run = tmp_path / "run.toml"
    run.write_text('[model]\nconfig = "tiny"\noverrides = {num_hidden_layers = 4, hidden_size = 32}\n')
    assert main(["flops", "--model", str(run), "--seq-lens", "8"]) == 0
    out = capsys.readouterr().out
    cfg = parse_config({**tiny_config().to_dict(), "hidden_size": 32}).text
    assert f"{count_flops(cfg, [8])['lm_head'] / 1e9:12.4f} G" in out
