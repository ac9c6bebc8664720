"""The README's examples, run as written against the demo `make serve` builds (the same
command, seed and size), served by a real `duet serve`: every curl line of its Search block
and its Python client block answer 200, and the answers are what the README says they are
(the text query's first hit fits it; the image query's first captions describe that
image)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from models.world import Scene, satisfies
from tests.conftest import DUET, REPO, Service, start_service, stop_service

README = (REPO / "README.md").read_text()
# what `make demo-index` runs (Makefile): the demo every README example is written against
MAKEFILE = (REPO / "Makefile").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    """`make demo-index`'s command into a temporary folder, then `duet serve` on it."""
    line = next(ln for ln in MAKEFILE.splitlines() if "duet demo-index" in ln)
    args = shlex.split(line.split("duet demo-index", 1)[1])
    # --out $(INDEXES) / --corpus-out $(DEMO): ours below
    args = [a for i, a in enumerate(args) if "$(" not in " ".join(args[i : i + 2])]
    assert "--images" in args and "--seed" in args, line
    root = tmp_path_factory.mktemp("demo")
    corpus, indexes = root / "data" / "demo", root / "indexes"
    subprocess.run(
        [
            *DUET,
            "demo-index",
            "--out",
            str(indexes),
            "--corpus-out",
            str(corpus),
            *args,
            "--no-progress",
        ],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    # as `make serve` does: GET /images serves the demo corpus from DUET_IMAGES_DIR
    svc = start_service(indexes, root / "serve.log", DUET_IMAGES_DIR=str(corpus))
    yield svc, root
    stop_service(svc)


def _scene(meta: dict[str, object]) -> Scene:
    return Scene.from_json(meta["scene"])  # type: ignore[arg-type]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_every_curl_example_answers_as_the_readme_says(demo: tuple[Service, Path]) -> None:
    svc, root = demo
    search = README.split("## Search", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", search, flags=re.S)
    assert block is not None
    commands = block.group(1).replace("\\\n", " ").strip().splitlines()
    assert len(commands) >= 3
    answers = []
    for cmd in commands:
        cmd = cmd.replace("http://127.0.0.1:8000", svc.url)
        out = subprocess.run(
            ["bash", "-c", cmd + " -w '\\n%{http_code}'"],
            cwd=root,  # data/demo/... as after `make serve`
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        body, status = out.rsplit("\n", 1)
        assert status == "200", (cmd, body)
        answers.append(json.loads(body))
    text, *images = answers

    query = json.loads(re.search(r"-d '(\{.*?\})'", commands[0]).group(1))["query"]  # type: ignore[union-attr]
    top = text["hits"][0]
    assert satisfies(query, _scene(top["meta"])), (query, top)
    # the image examples: the image's own captions come first
    image_id = re.search(r"images/(\d+)\.png", commands[1]).group(1)  # type: ignore[union-attr]
    for ans in images:
        assert ans["hits"][0]["meta"]["image_id"].endswith(image_id), ans["hits"][0]


def test_the_python_client_example_runs_as_written(
    demo: tuple[Service, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    svc, root = demo
    blocks = [b for b in _blocks("python") if "DuetClient" in b]
    assert blocks, "the README shows the Python client"
    monkeypatch.chdir(root)
    for code in blocks:
        exec(compile(code.replace("http://127.0.0.1:8000", svc.url), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "images/" in printed and printed.count("\n") >= 5


def _dry_run(*args: str) -> str:
    """What `make ARGS` would run (make -n: nothing is run, installed or built)."""
    return subprocess.run(
        ["make", "-n", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout


def test_the_top_keeps_exactly_the_two_setup_commands() -> None:
    first = _blocks("sh")[0]
    assert [ln.split("#")[0].strip() for ln in first.strip().splitlines()] == [
        "make serve",
        "make test",
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_readme_says_how_to_pick_a_port_and_it_works() -> None:
    line = next(ln for ln in README.splitlines() if ln.startswith("Another port:"))
    cmd = re.search(r"`make serve PORT=(\d+)`", line)
    assert cmd is not None, line
    port = cmd.group(1)
    assert f"http://127.0.0.1:{port}/" in line
    assert f"DUET_PORT={port} " in _dry_run("serve", f"PORT={port}")


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_readme_says_how_long_the_tests_take_and_that_test_fast_exists() -> None:
    top = README.split("## ", 1)[0]
    took = re.search(r"`make test` takes about (\d+) to (\d+) minutes on (\d+) CPU cores", top)
    assert took is not None, "the README's top says how long `make test` takes"
    fast = next(ln for ln in top.splitlines() if ln.startswith("`make test-fast`"))
    assert "no real service" in fast
    assert '-m "not slow"' in _dry_run("test-fast")
