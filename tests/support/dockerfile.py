"""A Dockerfile replayed on this machine, without Docker: each stage's filesystem is a folder (`root`), its
Python a fresh venv, its RUN lines the same pip and python commands. Only the constructs our Dockerfiles use
are understood; anything else raises `Unsupported`, so a new construct fails the test rather than being skipped.

What cannot run here is checked instead or said: `apt-get install` (the packages must already be installed on
this machine), `useradd`/`chown`/`USER` (everything runs as the test's user).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

BASE_IMAGES = frozenset({"python:3.11-slim"})   # stood in for by a venv of this interpreter (3.11) at /usr/local
DOCKER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"   # the python image's PATH
IGNORED = frozenset({"EXPOSE", "HEALTHCHECK", "USER"})   # no effect on the Python environment or the files
_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


class Unsupported(Exception):
    """A Dockerfile construct this replay does not understand."""


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str     # FROM, RUN, COPY, ... (upper case)
    args: str        # the rest of the instruction, continuation lines joined


def parse(text: str) -> list[Instruction]:
    """The instructions, comments dropped and `\\`-continued lines joined."""
    instructions: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    if pending:
        raise Unsupported(f"a continuation line ends the file: {pending!r}")
    return instructions


@dataclass
class Stage:
    """One FROM stage being replayed: its filesystem root, ENV, working directory and start command."""
    name: str | None
    root: Path
    env: dict[str, str] = field(default_factory=lambda: {"PATH": DOCKER_PATH})
    workdir: str = "/"
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)

    def host_path(self, path: str) -> Path:
        """Where the image's absolute `path` lies on this machine."""
        return self.root / path.lstrip("/")

    def process_env(self, extra: Mapping[str, str] = {}) -> dict[str, str]:
        """The environment of a process in this image: its ENV (image paths mapped here) and `extra` (compose's).
        Host tools the image installs with apt (gcc, g++) come from this machine's PATH, after the image's."""
        env = {"HOME": str(self.root / "home"), "LANG": "C.UTF-8"}
        for name, value in {**self.env, **extra}.items():
            env[name] = str(self.host_path(value)) if value.startswith("/") and name != "PATH" else value
        image_path = [str(self.host_path(part)) for part in self.env["PATH"].split(":")]
        env["PATH"] = ":".join([*image_path, os.environ.get("PATH", "")])
        return env

    def which(self, program: str) -> str:
        found = shutil.which(program, path=self.process_env()["PATH"])
        if found is None:
            raise Unsupported(f"{program!r} is not on the image's PATH")
        return found


class Build:
    """Replays a Dockerfile. `build_args` override ARG defaults (a substitution the test states)."""

    def __init__(self, dockerfile: Path, context: Path, workdir: Path, build_args: Mapping[str, str] = {},
                 log: Path | None = None) -> None:
        self.dockerfile, self.context, self.workdir = dockerfile, context, workdir
        self.args: dict[str, str] = {}
        self.build_args = dict(build_args)
        self.stages: list[Stage] = []
        self.apt_packages: list[str] = []   # what the image installs with apt-get (checked on this machine)
        self.log = (log or workdir / "build.log").open("a")

    @property
    def image(self) -> Stage:
        """The last stage: the image that runs."""
        return self.stages[-1]

    def run(self) -> Build:
        for instruction in parse(self.dockerfile.read_text()):
            handler = getattr(self, f"_do_{instruction.keyword.lower()}", None)
            if instruction.keyword in IGNORED:
                continue
            if handler is None or (not self.stages and instruction.keyword not in ("ARG", "FROM")):
                raise Unsupported(f"{self.dockerfile.name}: {instruction.keyword} {instruction.args}")
            handler(instruction.args)
        self.log.close()
        return self

    def _expand(self, text: str) -> str:
        values = {**self.args, **(self.stages[-1].env if self.stages else {})}

        def value(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            if name not in values:
                raise Unsupported(f"{self.dockerfile.name}: ${name} is neither an ARG nor an ENV")
            return values[name]
        return _VAR.sub(value, text)

    def _do_arg(self, args: str) -> None:
        name, sep, default = args.partition("=")
        if not sep or not re.fullmatch(r"\w+", name):
            raise Unsupported(f"ARG without a default: {args}")
        self.args[name] = self.build_args.get(name, " ".join(shlex.split(default)))

    def _do_from(self, args: str) -> None:
        words = self._expand(args).split()
        if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
            raise Unsupported(f"FROM {args}")
        if words[0] not in BASE_IMAGES:
            raise Unsupported(f"base image {words[0]} (known: {sorted(BASE_IMAGES)})")
        stage = Stage(words[2] if len(words) == 3 else None, self.workdir / f"stage{len(self.stages)}")
        self._call([sys.executable, "-m", "venv", str(stage.host_path("/usr/local"))], stage)
        self.stages.append(stage)

    def _do_env(self, args: str) -> None:
        for pair in shlex.split(args):
            name, sep, value = pair.partition("=")
            if not sep:
                raise Unsupported(f"ENV in the `ENV name value` form: {args}")
            self.image.env[name] = self._expand(value)

    def _do_workdir(self, args: str) -> None:
        self.image.workdir = str(Path(self.image.workdir) / self._expand(args))
        self.image.host_path(self.image.workdir).mkdir(parents=True, exist_ok=True)

    def _do_copy(self, args: str) -> None:
        words = shlex.split(self._expand(args))
        source_root, source_stage = self.context, None
        if words[0].startswith("--from="):
            source_stage = next((s for s in self.stages if s.name == words[0].removeprefix("--from=")), None)
            if source_stage is None:
                raise Unsupported(f"COPY from an unknown stage: {args}")
            words = words[1:]
        if len(words) < 2 or any(w.startswith("--") for w in words):
            raise Unsupported(f"COPY {args}")
        *sources, dest = words
        target = self.image.host_path(str(Path(self.image.workdir) / dest))
        for source in sources:
            if source_stage is not None:
                _copy_tree(source_stage.host_path(source), target, into=dest.endswith("/"))
            else:
                _copy_context(source_root, source, target, into=dest.endswith("/") or len(sources) > 1)

    def _do_entrypoint(self, args: str) -> None:
        self.image.entrypoint = _exec_form(args)

    def _do_cmd(self, args: str) -> None:
        self.image.cmd = _exec_form(args)

    def _do_run(self, args: str) -> None:
        lexer = shlex.shlex(self._expand(args), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        if tokens[:4] == ["if", "!", "command", "-v"]:
            self._run_if_missing(tokens)
            return
        for step in _split(tokens, "&&"):
            self._run_step(step)

    def _run_if_missing(self, tokens: list[str]) -> None:
        """`if ! command -v X >/dev/null; then ...; fi`: installs X on a base image without it; ours has it."""
        if tokens[5:7] != [">", "/dev/null"] or tokens[7:9] != [";", "then"] or tokens[-2:] != [";", "fi"]:
            raise Unsupported(f"RUN {' '.join(tokens)}")
        self.image.which(tokens[4])   # present: the body does not run (absent: Unsupported)

    def _run_step(self, step: list[str]) -> None:
        cwd = self.image.host_path(self.image.workdir)
        if step[0] == "(" and step[-1] == ")" and step[1] == "cd" and step[3] == "&&":   # (cd DIR && CMD)
            cwd, step = self.image.host_path(step[2]), step[4:-1]
        if any(token in ("&&", "||", ";", "|", "(", ")", ">", "<", "&") for token in step):
            raise Unsupported(f"RUN step {' '.join(step)}")
        program, rest = step[0], [str(self.image.host_path(a)) if a.startswith("/") else a for a in step[1:]]
        if program.startswith("python") and "-c" in rest and re.search(r"['\"]/", rest[rest.index("-c") + 1]):
            raise Unsupported(f"an absolute path inside python code (the replay cannot move it): {' '.join(step)}")
        if program in ("pip", "pip3", "python", "python3"):
            if program.startswith("pip"):
                rest = [arg for arg in rest if arg != "--no-cache-dir"]   # pip's download cache may serve
            self._call([self.image.which(program), *rest], self.image, cwd)
        elif program == "apt-get":
            self._apt_get(step[1:])
        elif program == "mkdir" and step[1:2] == ["-p"]:
            for path in step[2:]:
                self.image.host_path(path).mkdir(parents=True, exist_ok=True)
        elif program == "rm" and step[1:2] == ["-rf"] and all(p.startswith("/var/lib/apt/lists/") for p in step[2:]):
            pass   # apt's lists: nothing here
        elif program in ("useradd", "chown"):
            pass   # users: everything runs as the test's own user
        else:
            raise Unsupported(f"RUN step {' '.join(step)}")

    def _apt_get(self, args: list[str]) -> None:
        if args == ["update"]:
            return
        words = [arg for arg in args if not arg.startswith("-")]
        if words[:1] != ["install"]:
            raise Unsupported(f"apt-get {' '.join(args)}")
        self.apt_packages += words[1:]
        for package in words[1:]:
            status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
            if "install ok installed" not in status.stdout:
                raise AssertionError(f"the image installs {package} with apt-get; install it here too")

    def _call(self, argv: list[str], stage: Stage, cwd: Path | None = None) -> None:
        started_s = time.monotonic()
        print(f"$ {' '.join(argv)}  (in {cwd or self.workdir})", file=self.log, flush=True)
        # pip's settings of this machine (its index, as Docker's build network would be) and its download cache
        pip = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
        pip.setdefault("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
        done = subprocess.run(argv, cwd=cwd or self.workdir, env={**stage.process_env(), **pip}, stdout=self.log,
                              stderr=subprocess.STDOUT)
        print(f"# {time.monotonic() - started_s:.1f} s", file=self.log, flush=True)
        if done.returncode:
            self.log.close()
            tail = Path(self.log.name).read_text(errors="replace")[-6000:]
            raise AssertionError(f"{self.dockerfile.name}: {' '.join(argv)} failed ({done.returncode}):\n{tail}")


def _split(tokens: list[str], separator: str) -> list[list[str]]:
    """Split on `separator` outside parentheses."""
    steps: list[list[str]] = [[]]
    depth = 0
    for token in tokens:
        depth += token.count("(") - token.count(")") if set(token) <= set("()") else 0
        if token == separator and depth == 0:
            steps.append([])
        else:
            steps[-1].append(token)
    return steps


def _exec_form(args: str) -> list[str]:
    import json
    value = json.loads(args) if args.startswith("[") else None
    if not isinstance(value, list) or not all(isinstance(word, str) for word in value):
        raise Unsupported(f"a shell-form command (only the exec form, a JSON list, is replayed): {args}")
    return value


def _copy_context(context: Path, source: str, target: Path, into: bool) -> None:
    """The files of the build context under `source`: those git tracks or would track (a clean checkout's)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", source],
                            cwd=context, check=True, capture_output=True, text=True).stdout.split()
    files = [name for name in listed if (context / name).is_file()]
    if not files:
        raise AssertionError(f"COPY {source}: nothing in the build context")
    if (context / source).is_file():
        _copy_file(context / source, target / Path(source).name if into else target)
        return
    for name in files:
        _copy_file(context / name, target / Path(name).relative_to(source))


def _copy_tree(source: Path, target: Path, into: bool) -> None:
    if source.is_dir():
        shutil.copytree(source, target, dirs_exist_ok=True)
    elif source.is_file():
        _copy_file(source, target / source.name if into else target)
    else:
        raise AssertionError(f"COPY --from: {source} does not exist in that stage")


def _copy_file(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)
