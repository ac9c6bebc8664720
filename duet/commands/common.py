"""What every `duet` command shares: the one settings path, the model choices, errors."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.config import Settings

log = logging.getLogger("duet")

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


class HelpFormatter(argparse.HelpFormatter):
    """--help shows every option's default: appended as "(default: X)" unless the option's
    own help already says what its default is, or there is none to show. A description's or
    epilog's paragraph whose lines are indented (an example's commands) is kept as written;
    the others are wrapped to the terminal."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = text.split("\n\n")
        return "\n\n".join(
            p if p.startswith("  ") else super(HelpFormatter, self)._fill_text(p, width, indent)
            for p in paragraphs
        )

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def load_settings(**overrides: Any) -> Settings:
    """The one configuration of every command: DUET_* from the environment or .env
    (`app.config.Settings`), a command's flags given as `overrides`."""
    from pydantic import ValidationError

    from app.config import Settings
    from models.errors import UserError

    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        said: dict[str, list[str]] = {}  # a union's members each explain themselves
        for e in exc.errors():
            field = str(e["loc"][0])
            # the command's flag where it gave the value (--port 99999 was told as DUET_PORT)
            flag = "--factory" if field == "index_factory" else f"--{field.replace('_', '-')}"
            named = flag if overrides.get(field) is not None else _where(f"DUET_{field.upper()}")
            said.setdefault(named, []).append(e["msg"].removeprefix("Value error, "))
        bad = "; ".join(f"{name}: {' or '.join(msgs)}" for name, msgs in said.items())
        raise UserError(f"invalid setting(s): {bad} (see .env.example for every setting)") from exc
    _tell_unknown(Settings)
    return settings


def _where(name: str) -> str:
    """`name`, and "in ./.env" when the value came from there (not from the environment)."""
    import os

    if name not in os.environ and name in _env_file():
        return f"{name} (in ./.env)"
    return name


def _env_file() -> dict[str, str]:
    """The variables ./.env sets (NAME=value lines, `export ` allowed), as pydantic-settings
    reads the file for `Settings`; empty when there is none or it cannot be read."""
    env = Path(".env")
    try:
        lines = env.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        name, eq, value = line.strip().removeprefix("export ").partition("=")
        if eq and name.strip() and not name.startswith("#"):
            found[name.strip()] = value.strip()
    return found


# DUET_* variables that are no setting: docker-compose's (.env.example), the process
# layout's own (app.fronts), the CLI's and the tests'
NOT_SETTINGS = {"FLAVOR", "PUBLISH_ADDR", "PUBLISH_PORT", "CORPUS_DIR", "CORPUS_MANIFEST"}
NOT_SETTINGS |= {"TRACEBACK", "TEST_NO_APT", "SCREENSHOT"}


def _tell_unknown(settings: type[Settings]) -> None:
    """Warn of a DUET_* variable that names no setting (a typo such as DUET_REDIS_ULR was
    silently ignored: the service ran on its default), naming the setting it is closest to.
    Kubernetes' service links (DUET_API_PORT=tcp://..., *_SERVICE_HOST) are not told."""
    import difflib
    import os

    if "DUET_FRONT_FD" in os.environ:  # a front: its owner told it
        return
    known = {f"DUET_{name.upper()}" for name in settings.model_fields}
    given = {**{n: v for n, v in _env_file().items() if n not in os.environ}, **os.environ}
    for name, value in sorted(given.items()):
        # read as pydantic-settings reads them: in any case
        rest = name.upper().removeprefix("DUET_")
        if (
            rest == name.upper()
            or name.upper() in known
            or rest in NOT_SETTINGS
            or rest.startswith("FRONT_")
            or "_SERVICE_" in f"_{rest}"  # a Service "duet" links DUET_SERVICE_HOST too
            or "_PORT_" in f"_{rest}"
            or value.startswith(("tcp://", "udp://"))
        ):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        log.warning(
            "ignoring %s: no duet setting has that name%s (docs/configuration.md lists them)",
            _where(name),
            f"; did you mean {close[0]}?" if close else "",
        )


def model_choices(args: argparse.Namespace, settings: Settings) -> tuple[str, str, tuple[str, str]]:
    """(encoder, reranker, their labels for errors): --encoder / --reranker, else DUET_ENCODER /
    DUET_RERANKER (the service's settings, so a build matches what is served)."""
    enc_flag, rr_flag = getattr(args, "encoder", None), getattr(args, "reranker", None)
    return (
        enc_flag or settings.encoder,
        rr_flag or settings.reranker,
        ("--encoder" if enc_flag else "DUET_ENCODER", "--reranker" if rr_flag else "DUET_RERANKER"),
    )


def unwritable(flag: str, out: Path) -> str | None:
    """Why a command could not write a folder at `out` (given by `flag`), or None: told
    before the work, not after it (`duet train --out FILE` trained for its whole run, then
    failed on the file)."""
    import os

    if out.exists() and not out.is_dir():
        return f"{flag} {out} is a file: give a folder to write into (it is made if missing)"
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{flag} {out}: {parent} is a file, so no folder can be made there"
    if not os.access(parent, os.W_OK | os.X_OK):
        try:  # a read-only mount is no matter of this user's rights
            read_only = bool(os.statvfs(parent).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        if read_only:
            return f"{flag} {out}: {parent} is on a read-only file system; give another folder"
        return f"{flag} {out}: {parent} cannot be written to by this user"
    return None


def fail(message: str) -> int:
    print(f"duet: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def model_options(p: argparse.ArgumentParser, verb: str) -> None:
    """--encoder and --reranker: the same choices as DUET_ENCODER and DUET_RERANKER."""
    p.add_argument(
        "--encoder",
        default=None,
        help=f"the bi-encoder it {verb} with: builtin (duet's model, --model-dir) or a "
        "local Hugging Face CLIP / SigLIP directory (default: $DUET_ENCODER, else "
        "builtin)",
    )
    p.add_argument(
        "--reranker",
        default=None,
        help="the re-ranker whose image tokens the index stores and that re-ranks: "
        "ce (duet's cross-encoder; builtin is its older name), late, han, none, or a local "
        "Hugging Face BLIP image-text-matching directory (default: $DUET_RERANKER, else ce)",
    )


def index_corpus(index: Path) -> dict[str, object] | None:
    """What `duet eval` evaluated: the corpus file an index was built from and its split."""
    from store.indexio import Manifest, version_dir

    manifest = Manifest.read(version_dir(index))
    if manifest.corpus is None:
        return None
    selection = manifest.corpus_selection
    changed = manifest.base  # an --append / --delete: `corpus` is what it read, if anything
    return {
        "path": manifest.corpus,
        **(selection.to_json() if selection else {"format": "manifest"}),
        **({"changed_from": changed.version} if changed and changed.version else {}),
    }
