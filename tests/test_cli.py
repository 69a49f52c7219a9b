"""CLI transcripts with CliRunner: generate, chat REPL, and every bad input -> one line, exit 2."""

import json

import pytest
from click.testing import CliRunner

from edgerun.cli import main


@pytest.fixture()
def runner():
    return CliRunner()


def gen(runner, model, *args, input=None):
    return runner.invoke(main, ["generate", *args, "--model", str(model), "--draft", "none",
                                "--profile", "generic-x86_64-cpu", "--threads", "2", "--ctx", "256"], input=input)


def test_version(runner):
    r = runner.invoke(main, ["--version"])
    assert r.exit_code == 0 and "edgerun, version" in r.output


def test_generate_json(runner, tiny_llama):
    r = gen(runner, tiny_llama, "the cat is", "-n", "8", "-t", "0", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["n_tokens"] == 8 and out["finish_reason"] == "length"
    for key in ("text", "tokens_per_s", "acceptance_rate", "accept_histogram", "t_prefill_s"):
        assert key in out


def test_generate_text_matches_json_and_seed_repeats(runner, tiny_llama):
    a = gen(runner, tiny_llama, "the cat is", "-n", "10", "--seed", "3", "--json")
    b = gen(runner, tiny_llama, "the cat is", "-n", "10", "--seed", "3")
    assert a.exit_code == 0 and b.exit_code == 0
    assert json.loads(a.stdout)["text"] == b.stdout[:-1]     # plain output ends with one newline


def test_prompt_from_stdin(runner, tiny_llama):
    r = gen(runner, tiny_llama, "-", "-n", "3", "-t", "0", "--json", input="the water")
    assert r.exit_code == 0 and json.loads(r.stdout)["n_prompt_tokens"] > 1


@pytest.mark.parametrize("args, message", [
    (["-t", "-1"], "temperature must be"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--gamma", "-3"], "gamma must be"),
    (["--gamma", "1000"], "gamma must be"),
    (["--gamma", "lots"], "gamma must be"),
    (["-n", "-5"], "max-tokens"),
])
def test_bad_sampling_values(runner, tiny_llama, args, message):
    r = gen(runner, tiny_llama, "hi", *args)
    assert r.exit_code == 2
    assert message in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_models(runner, tmp_path, tiny_llama):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 definitely a zip")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_llama.read_bytes()[:5000])
    cases = [("no-such-model", "unknown model"), (tmp_path / "missing.gguf", "no such file"),
             (junk, "not a GGUF file"), (cut, "truncated")]
    for model, message in cases:
        r = gen(runner, model, "hi")
        assert r.exit_code == 2, (model, r.output)
        assert message in r.stderr and "Traceback" not in r.output


def test_prompt_longer_than_context(runner, tiny_llama):
    r = gen(runner, tiny_llama, "the cat " * 400, "-n", "4")
    assert r.exit_code == 2 and "context holds" in r.stderr and "Traceback" not in r.output


def test_chat_transcript(runner, tiny_llama):
    script = "hello there\n/stats\n/bogus\nthe cat\n/reset\nagain\n/exit\n"
    r = runner.invoke(main, ["chat", "--model", str(tiny_llama), "--draft", "none", "-n", "6", "-t", "0",
                             "--profile", "generic-x86_64-cpu", "--ctx", "256"], input=script)
    assert r.exit_code == 0, r.output
    assert r.stdout.count(">>> ") == 7
    assert "[last answer] tokens 6" in r.stderr
    assert "unknown command /bogus" in r.stderr
    assert "(history cleared)" in r.stderr


def test_chat_ends_on_eof(runner, tiny_llama):
    r = runner.invoke(main, ["chat", "--model", str(tiny_llama), "--draft", "none", "-n", "3",
                             "--profile", "generic-x86_64-cpu", "--ctx", "256"], input="hi\n")
    assert r.exit_code == 0


def test_chat_drops_oldest_turns_when_context_is_full(runner, tiny_llama):
    long = "the cat is in the water " * 12          # ~100 tokens per message
    script = f"{long}\n{long}\n{long}\n{long}\n/exit\n"
    r = runner.invoke(main, ["chat", "--model", str(tiny_llama), "--draft", "none", "-n", "4", "-t", "0",
                             "--profile", "generic-x86_64-cpu", "--ctx", "256"], input=script)
    assert r.exit_code == 0, r.output
    assert "dropped the oldest turn" in r.stderr and "error" not in r.stderr


TINY = ["--draft", "none", "--profile", "generic-x86_64-cpu", "--ctx", "512"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def test_generate_under_a_json_schema(runner, tiny_llama, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    for spec in (str(schema), json.dumps(PERSON)):          # a file, or inline JSON
        r = runner.invoke(main, ["generate", "A person:", "--model", str(tiny_llama), *TINY, "-n", "60",
                                 "-t", "0.9", "--seed", "3", "--json-schema", spec, "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        if out["finish_reason"] == "eos":
            assert set(json.loads(out["text"])) == {"name", "n"}
        else:
            assert out["text"].startswith('{"name": "')


def test_generate_under_a_grammar_file(runner, tiny_llama, tmp_path):
    g = tmp_path / "answer.regex"
    g.write_text("(yes|no)!")
    r = runner.invoke(main, ["generate", "Say it:", "--model", str(tiny_llama), *TINY, "-n", "8", "-t", "1",
                             "--grammar", str(g)])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() in ("yes!", "no!")
    lark = tmp_path / "g.lark"
    lark.write_text('start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]{1,2}/\n')
    r = runner.invoke(main, ["generate", "Numbers:", "--model", str(tiny_llama), *TINY, "-n", "30", "-t", "1",
                             "--seed", "1", "--grammar", str(lark), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["text"].startswith("[")


@pytest.mark.parametrize("args, message", [
    (["--json-schema", '{"type": "objekt"}'], "JSON schema does not compile"),
    (["--json-schema", "{not json"], "not valid JSON"),
    (["--json-schema", "nowhere.json"], "is not a JSON file or inline JSON"),
    (["--grammar", "nowhere.lark"], "is not a file"),
    (["--json-schema", "{}", "--grammar", "{}"], "at most one"),
])
def test_bad_structure_options_get_one_line(runner, tiny_llama, args, message):
    r = runner.invoke(main, ["generate", "x", "--model", str(tiny_llama), *TINY, "-n", "2", *args])
    assert r.exit_code == 2 and r.output.startswith("error: ") and message in r.output, r.output
    assert "Traceback" not in r.output


def test_chat_with_tools_prints_calls_and_takes_results(runner, tiny_llama, tmp_path):
    tools = [{"type": "function", "function": {"name": "turn_on", "parameters": {
        "type": "object", "properties": {"room": {"type": "string", "enum": ["kitchen", "hall"]}},
        "required": ["room"]}}}]
    f = tmp_path / "tools.json"
    f.write_text(json.dumps(tools))
    script = "light the kitchen\n{\"ok\": true}\n/exit\n"
    r = runner.invoke(main, ["chat", "--model", str(tiny_llama), *TINY, "--ctx", "2048", "-n", "150", "-t", "0",
                             "--tools", str(f), "--tool-choice", "turn_on"], input=script)
    assert r.exit_code == 0, r.output
    assert '[tool call] turn_on({"room": "' in r.stdout and "result of turn_on> " in r.stdout
    r = runner.invoke(main, ["chat", "--model", str(tiny_llama), *TINY, "--tools", "[{\"type\": \"function\"}]"],
                      input="/exit\n")
    assert r.exit_code == 2 and r.output.startswith("error: ") and "tools[0]" in r.output, r.output
    r = runner.invoke(main, ["chat", "--model", str(tiny_llama), *TINY, "--tools", str(f), "--tool-choice", "fly"],
                      input="/exit\n")
    assert r.exit_code == 2 and "not among the tools" in r.output, r.output


def test_invalid_utf8_prompts_get_one_line_not_a_traceback(runner, tiny_llama):
    """Issue 20, defect 2: invalid UTF-8 on argv (surrogate-escaped by Python) and a lone surrogate."""
    for prompt in ("\udcff\udcfeabc", "a\ud800b"):
        r = runner.invoke(main, ["generate", prompt, "--model", str(tiny_llama), "-n", "2"])
        assert r.exit_code == 2 and r.output.startswith("error: ") and "not valid Unicode" in r.output, r.output
        assert "Traceback" not in r.output
