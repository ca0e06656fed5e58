"""ServerConfig's fields, `tinkerd serve`'s flags and docs/configuration.md's tables are one to one
(tinkerd/cli/flags.py derives the flags from the fields), and the flags the tests, scripts and docs
use keep their names and meaning."""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

import pytest

from tinkerd.cli import accounts, flags, fsck, keys, main, serve, usage
from tinkerd.config import ServerConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve.add_parser(sub)
    return sub.choices["serve"]


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(list(argv))


def _serve_flags() -> dict[str, list[str]]:
    """dest -> option strings of every option of `tinkerd serve` but --help."""
    return {a.dest: a.option_strings for a in _parser()._actions if a.option_strings and a.dest != "help"}


def _documented() -> set[str]:
    """Every `--flag` named in the first column of docs/configuration.md's tables."""
    names = set()
    for line in DOCS.read_text().splitlines():
        if line.startswith("| `--"):
            names.update(re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1]))
    return names


def test_every_field_has_a_flag_or_a_reason_and_every_flag_a_field():
    fields = set(ServerConfig.model_fields)
    assert all(reason.strip() for reason in flags.NOT_FLAGS.values())
    assert set(flags.NOT_FLAGS) <= fields
    by_dest = _serve_flags()
    assert set(by_dest) == fields - set(flags.NOT_FLAGS)  # no field without a flag, no flag without a field
    for name, options in by_dest.items():
        assert flags.flag_name(name) in options
        if name not in flags.RENAMED:
            assert flags.flag_name(name) == "--" + name.replace("_", "-")


def test_every_flag_has_a_row_in_the_docs_and_every_row_a_flag():
    documented = _documented()
    for name, options in _serve_flags().items():
        assert documented & set(options), f"{options[0]} has no row in docs/configuration.md"
    every_option = {o for options in _serve_flags().values() for o in options}
    assert documented <= every_option, f"rows for no flag: {sorted(documented - every_option)}"


def test_help_lists_every_flag_with_its_description_and_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # argparse wraps help to the terminal, at spaces and hyphens
    with pytest.raises(SystemExit) as exited:
        main.main(["serve", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for name, info in flags.flag_fields().items():
        assert flags.flag_name(name) in text
        assert info.description and info.description in text
        if info.default_factory is None and info.default is not None:
            assert f"(default: {flags._shown(info.default)})" in text
        else:  # computed at start or None: the description itself says what applies when it is not given
            assert "default" in info.description


def _a_value_other_than_the_default(name: str, info) -> tuple[list[str], object]:
    """Command-line words for the field and the value they must give it."""
    annotation = flags._without_none(info.annotation)
    default = info.get_default(call_default_factory=True)
    if annotation is bool:
        return ([f"--no-{name.replace('_', '-')}"] if default else [flags.flag_name(name)]), not default
    if typing.get_origin(annotation) is typing.Literal:
        value = next(c for c in typing.get_args(annotation) if c != default)
        return [flags.flag_name(name), value], value
    if typing.get_origin(annotation) is list:
        return [flags.flag_name(name), "a", flags.flag_name(name), "b"], ["a", "b"]
    if annotation is Path:
        return [flags.flag_name(name), "/tmp/x"], Path("/tmp/x")
    if annotation is str:
        return [flags.flag_name(name), "x"], "x"
    value = (default or 0) + 1 if annotation is int else (default or 0) + 1.5
    most = min((m.le for m in info.metadata if hasattr(m, "le")), default=None)
    if most is not None and value > most:  # a bounded field (--snapshot-budget <= 1): halfway to its bound
        value = ((default or 0) + most) / 2
    return [flags.flag_name(name), str(value)], value


@pytest.mark.parametrize("name", sorted(flags.flag_fields()))
def test_each_flag_sets_its_field(name):
    words, value = _a_value_other_than_the_default(name, ServerConfig.model_fields[name])
    config = serve.build_config(_args(*words))
    assert getattr(config, name) == value
    others = {k: v for k, v in config.model_dump().items() if k != name}
    assert others == {k: v for k, v in ServerConfig().model_dump().items() if k != name}  # nothing else moved


def test_no_flags_is_serverconfigs_defaults_environment_included(monkeypatch, tmp_path):
    monkeypatch.setenv("TINKERD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TINKERD_DB_URL", "postgresql+psycopg://u@/db")
    config = serve.build_config(_args())
    assert config == ServerConfig()
    assert (config.data_dir, config.db_url) == (tmp_path, "postgresql+psycopg://u@/db")
    assert serve.build_config(_args("--db-url", "sqlite:///x")).db_url == "sqlite:///x"  # the flag wins


def test_the_flags_in_use_keep_their_names_and_meaning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = serve.build_config(_args(
        "--threads", "2", "--base-model", "tinkerd/tiny-qwen3", "--base-model", "tinkerd/tiny-llama", "--no-metrics",
        "--sample-kv-cache-gb", "0.01", "--min-free-disk-gb", "0", "--max-queued-ops-per-model", "0",
        "--max-queued-ops", "7", "--data-dir", "data", "--checkpoint-sweep-interval-s", "0.2", "--allow-non-finite",
        "--activation-memory-gb", "0"))
    assert config.torch_threads == 2
    assert config.base_models == ["tinkerd/tiny-qwen3", "tinkerd/tiny-llama"]
    assert config.metrics is False and config.allow_non_finite is True
    assert (config.sample_kv_cache_gb, config.min_free_disk_gb) == (0.01, 0)
    assert (config.max_queued_ops_per_model, config.max_queued_ops) == (None, 7)  # 0: no bound
    assert config.data_dir == tmp_path / "data"  # made absolute
    assert config.checkpoint_sweep_interval_s == 0.2
    assert (config.activation_memory_bytes, ServerConfig().activation_memory_bytes) == (0, None)  # 0: always recompute


@pytest.mark.parametrize("words, says", [
    (["--max-lora-rank", "0"], "--max-lora-rank: input should be greater than or equal to 1, got '0'"),
    (["--sample-kv-cache-gb", "0"], "--sample-kv-cache-gb: input should be greater than 0"),
    (["--max-queued-ops", "-1"], "or 0 for no bound, got '-1'"),
    (["--threads", "1.5"], "--threads: input should be a valid integer"),
    (["--device", "tpu"], "--device: invalid choice: 'tpu'"),
])
def test_a_bad_value_is_a_usage_error_naming_the_flag(words, says, capsys):
    with pytest.raises(SystemExit) as exited:
        main.main(["serve", *words])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


# The commands that open a data directory's store take serve's own store flags (cli/flags.py: STORE_FIELDS).
STORE_COMMANDS = {"keys": keys, "accounts": accounts, "usage": usage, "fsck": fsck}


def _command(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    STORE_COMMANDS[name].add_parser(parser.add_subparsers())
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    return {a.dest: (tuple(a.option_strings), a.help, a.metavar, getattr(a.type, "__name__", None), a.default)
            for a in parser._actions if a.dest in flags.STORE_FIELDS}


@pytest.mark.parametrize("name", sorted(STORE_COMMANDS))
def test_store_commands_take_serves_store_flags(name):
    command = _command(name)._subparsers._group_actions[0].choices[name]
    assert _options(command) == _options(_parser())  # one definition: name, help, default, value check
    assert set(_options(command)) == set(flags.STORE_FIELDS)


@pytest.mark.parametrize("name", sorted(STORE_COMMANDS))
def test_store_commands_read_the_flags_and_else_serverconfigs_defaults(name, tmp_path, monkeypatch):
    words = {"keys": ["list"], "accounts": ["list"], "usage": [], "fsck": []}[name]
    monkeypatch.chdir(tmp_path)
    args = _command(name).parse_args([name, "--data-dir", "d", "--db-url", "sqlite:///x", *words])
    config = flags.store_config(args)
    assert (config.data_dir, config.db_url) == (tmp_path / "d", "sqlite:///x")
    monkeypatch.setenv("TINKERD_DATA_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("TINKERD_DB_URL", "postgresql+psycopg://u@/db")
    assert flags.store_config(_command(name).parse_args([name, *words])) == ServerConfig()


def test_keys_and_accounts_work_on_the_database_db_url_names(pg_server_url, tmp_path, capsys):
    from tests.postgres import fresh_database

    url = fresh_database(pg_server_url)
    assert main.main(["keys", "--data-dir", str(tmp_path), "--db-url", url, "create", "--name", "ci",
                      "--account", "team-a"]) == 0
    assert main.main(["accounts", "--db-url", url, "set-quota", "team-a", "--max-concurrent-runs", "3"]) == 0
    capsys.readouterr()
    assert main.main(["accounts", "--db-url", url, "list"]) == 0
    assert re.search(r"^team-a\s+acct-\w+\s+3\s+default$", capsys.readouterr().out, re.M)
    assert not (tmp_path / "tinkerd.sqlite").exists()  # nothing went to the data directory's SQLite
