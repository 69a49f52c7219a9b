"""The one table of model settings (edgerun/settings_table.py): `edgerun generate`, `chat` and `serve` make
the same option from each record, and the --rpc / --tensor-split check answers alike from every way in."""

import pytest
from click.testing import CliRunner

import edgerun
from edgerun.cli import main
from edgerun.cli.run import chat, generate
from edgerun.cli.serving import serve
from edgerun.errors import InvalidArgument
from edgerun.runtime import load
from edgerun.serve.settings import SETTINGS, ServerConfig
from edgerun.settings_table import MODEL_SETTINGS

COMMANDS = {"generate": generate, "chat": chat, "serve": serve}
NOT_SERVED = {"n_gpu_layers"}          # the one model setting `edgerun serve` does not offer


def _params(command) -> dict:
    return {p.name: p for p in command.params}


def _shape(p) -> tuple:
    """What a user sees of an option: its flags, default, help, value name, type, whether it is a flag."""
    return (tuple(p.opts), tuple(p.secondary_opts), p.default, p.show_default, p.help, p.metavar, repr(p.type),
            p.is_flag)


def test_each_shared_setting_is_the_same_option_on_every_command():
    params = {name: _params(cmd) for name, cmd in COMMANDS.items()}
    assert set(MODEL_SETTINGS) <= set(params["generate"]) and set(MODEL_SETTINGS) <= set(params["chat"])
    assert set(MODEL_SETTINGS) & set(params["serve"]) == set(MODEL_SETTINGS) - NOT_SERVED
    for name, s in MODEL_SETTINGS.items():
        shapes = {cmd: _shape(p[name]) for cmd, p in params.items() if name in p}
        assert len(set(shapes.values())) == 1, (name, shapes)
        p = params["generate"][name]
        assert list(p.opts) == list(s.flags) and p.help == s.help, name
        assert p.is_flag == s.is_flag and (s.is_flag or p.default == s.default), name
        # serve reads every variable; the one-shot commands only those marked env_everywhere
        assert params["generate"][name].envvar == (s.env if s.env_everywhere else None), name
        if name in params["serve"]:
            assert params["serve"][name].envvar == s.env, name


def test_serve_settings_of_the_shared_kind_are_the_table_records():
    fields = ("name", "flags", "env", "help", "type", "default", "is_flag", "metavar", "env_everywhere")
    served = [s for s in SETTINGS if s.name in MODEL_SETTINGS]
    assert {s.name for s in served} == set(MODEL_SETTINGS) - NOT_SERVED
    for s in served:
        t = MODEL_SETTINGS[s.name]
        assert [getattr(s, f) for f in fields] == [getattr(t, f) for f in fields], s.name
    # a serve-only setting never reuses a shared flag or variable under another record
    others = [s for s in SETTINGS if s.name not in MODEL_SETTINGS]
    shared_flags = {f for t in MODEL_SETTINGS.values() for f in t.flags}
    assert not shared_flags & {f for s in others for f in s.flags}
    assert not {t.env for t in MODEL_SETTINGS.values()} & {s.env for s in others}


# (--rpc, --tensor-split) -> the one error; the model does not exist, so an error that came after the model
# was looked up would be a different one
CASES = [
    (None, "1,1", "--tensor-split needs --rpc (the workers to split the model over)"),
    ("127.0.0.1:50052", "0,0", "--tensor-split: the shares must add up to more than 0"),
    ("127.0.0.1:50052", "1,x", "--tensor-split: 'x' is not a number"),
    ("[::1]:50052", None, "--rpc: '[::1]:50052': ggml-rpc cannot reach IPv6 addresses"),
]


def _cli_error(argv, env=None) -> str:
    r = CliRunner().invoke(main, argv, env=env)
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output, r.stderr
    return lines[0][len("error: "):]


def _flags(rpc, tensor_split) -> list[str]:
    return (["--rpc", rpc] if rpc else []) + (["--tensor-split", tensor_split] if tensor_split else [])


@pytest.mark.parametrize("rpc, tensor_split, message", CASES)
def test_the_cluster_check_answers_alike_from_every_way_in(tmp_path, monkeypatch, rpc, tensor_split, message):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    model = ["--model", "no-such-model", "--no-pull"]
    errors = {
        "generate": _cli_error(["generate", "hi", *model, *_flags(rpc, tensor_split)]),
        "chat": _cli_error(["chat", *model, *_flags(rpc, tensor_split)]),
        "serve": _cli_error(["serve", *model, "--port", "0", *_flags(rpc, tensor_split)]),
        "serve, variables": _cli_error(["serve", *model, "--port", "0"],
                                       env={"EDGERUN_RPC": rpc, "EDGERUN_TENSOR_SPLIT": tensor_split}),
    }
    for name, call in {"edgerun.load": edgerun.load, "runtime.load": load}.items():
        with pytest.raises(InvalidArgument) as e:
            call("no-such-model", pull=False, rpc=rpc, tensor_split=tensor_split)
        errors[name] = str(e.value)
    with pytest.raises(InvalidArgument) as e:
        ServerConfig(model="no-such-model", rpc=tuple(rpc.split(",")) if rpc else (),
                     tensor_split=tuple(tensor_split.split(",")) if tensor_split else ())
    errors["ServerConfig"] = str(e.value)
    assert len(set(errors.values())) == 1, errors
    assert errors["generate"].startswith(message), errors


def test_shares_as_numbers_are_checked_like_the_flag(tmp_path, monkeypatch):
    """The Python API takes lists too: the same rule, the same words."""
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    with pytest.raises(InvalidArgument, match="^--tensor-split needs --rpc"):
        edgerun.load("no-such-model", pull=False, tensor_split=[3, 1])
