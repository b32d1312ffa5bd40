"""`softsearch serve --engine ray` refuses what it cannot serve with one `error:` line and exit 2."""

from __future__ import annotations

import pytest

from api.server import main


def test_engine_ray_needs_a_sharded_current_version(api_index, capsys):
    pytest.importorskip("ray.serve")
    assert main(["--engine", "ray", "--index", str(api_index["root"]), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1
    assert f"version {api_index['version']} is not sharded" in err and "index reshard" in err


def test_engine_ray_rejects_bad_shard_options(api_index, capsys):
    pytest.importorskip("ray.serve")
    assert (
        main(["--engine", "ray", "--index", str(api_index["root"]), "--port", "0", "--shard-replicas", "0"])
        == 2
    )
    assert "--shard-replicas" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse: one error line naming the choices
        main(["--engine", "spark", "--index", str(api_index["root"])])
    assert exit_info.value.code == 2 and "'local', 'ray'" in capsys.readouterr().err
