"""A small, strict reader of Dockerfiles and .dockerignore files, for checking the images without
a Docker engine.

It follows the Dockerfile reference for what our files use: parser directives and comments,
backslash line continuation, exec form (a JSON array) against shell form, ``--flag=value`` options,
``ARG``/``ENV`` with ``$VAR``/``${VAR}``/``${VAR:-default}`` substitution, multi-stage builds. It is
stricter than Docker where Docker is silently lenient: an unknown instruction, an instruction
before ``FROM``, or an argument that starts like a JSON array but is not one (Docker would run it
through a shell) is an error.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

KEYWORDS = frozenset(
    "ADD ARG CMD COPY ENTRYPOINT ENV EXPOSE FROM HEALTHCHECK LABEL ONBUILD RUN SHELL STOPSIGNAL "
    "USER VOLUME WORKDIR".split()
)
_FLAG = re.compile(r"--([a-z-]+)(?:=(\S*))?$")
_VAR = re.compile(r"\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


class DockerfileError(ValueError):
    pass


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    flags: dict[str, str]  # --from=builder -> {"from": "builder"}
    exec_form: list[str] | None  # the JSON array, for the exec form
    text: str  # the arguments after the flags, as written (shell form)
    line: int

    def words(self) -> list[str]:
        """The arguments as a list: the exec form, or the shell form split like a shell."""
        return list(self.exec_form) if self.exec_form is not None else shlex.split(self.text)


@dataclass
class Stage:
    base: str  # after substitution
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    global_args: dict[str, str]  # ARGs before the first FROM, with their defaults
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def env(self, stage: Stage) -> dict[str, str]:
        """The ENV a container of ``stage`` starts with (inherited stages included)."""
        env: dict[str, str] = {}
        parent = next((s for s in self.stages if s.name == stage.base), None)
        if parent is not None and parent is not stage:
            env.update(self.env(parent))
        for ins in stage.all("ENV"):
            env.update(parse_assignments(ins.text, env))
        return env

    def arg_defaults(self, stage: Stage) -> dict[str, str]:
        """Every ARG of ``stage`` with its default ('' when it has none)."""
        out: dict[str, str] = {}
        for ins in stage.all("ARG"):
            out.update(parse_assignments(ins.text, {**self.global_args, **out}, allow_bare=True))
        return out


def substitute(text: str, variables: dict[str, str]) -> str:
    """``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+alternative}`` as Docker does them."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        value = variables.get(name, "")
        if m.group(2) == "-":
            return value or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if value else ""
        return value

    return _VAR.sub(one, text)


def parse_assignments(
    text: str, variables: dict[str, str], allow_bare: bool = False
) -> dict[str, str]:
    """``KEY=value KEY2="v 2"`` (or the legacy ``KEY value``) of ENV / ARG."""
    words = shlex.split(text)
    if not words:
        raise DockerfileError("ENV/ARG without a name")
    if "=" not in words[0] and not allow_bare:
        if len(words) < 2:
            raise DockerfileError(f"ENV {words[0]} without a value")
        return {words[0]: substitute(" ".join(words[1:]), variables)}
    out: dict[str, str] = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_]\w*", name) or (not eq and not allow_bare):
            raise DockerfileError(f"bad assignment {word!r}")
        out[name] = substitute(value, {**variables, **out})
    return out


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join continued lines; drop comments, parser directives and blank lines."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and pending):
            continue  # comment lines vanish even inside a continued instruction
        if not stripped:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        out.append((start, " ".join(p for p in pending if p)))
        pending = []
    if pending:
        raise DockerfileError(f"line {start}: continuation at the end of the file")
    return out


def _instruction(number: int, line: str) -> Instruction:
    keyword, _, rest = line.partition(" ")
    keyword = keyword.upper()
    if keyword not in KEYWORDS:
        raise DockerfileError(f"line {number}: unknown instruction {keyword}")
    rest = rest.strip()
    flags: dict[str, str] = {}
    if keyword in ("FROM", "COPY", "ADD", "RUN", "HEALTHCHECK"):
        while rest.startswith("--"):
            word, _, rest = rest.partition(" ")
            m = _FLAG.match(word)
            if m is None:
                raise DockerfileError(f"line {number}: bad flag {word!r}")
            flags[m.group(1)] = m.group(2) or ""
            rest = rest.strip()
    exec_form = None
    if rest.startswith("["):
        try:
            parsed = json.loads(rest)
        except json.JSONDecodeError as e:
            raise DockerfileError(f"line {number}: {keyword} is not a valid JSON array") from e
        if not isinstance(parsed, list) or not all(isinstance(w, str) for w in parsed):
            raise DockerfileError(f"line {number}: {keyword} array must hold strings")
        exec_form = parsed
    if not rest and keyword not in ("CMD", "ENTRYPOINT"):
        raise DockerfileError(f"line {number}: {keyword} without arguments")
    return Instruction(keyword, flags, exec_form, rest, number)


def parse(text: str, build_args: dict[str, str] | None = None) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, line in _logical_lines(text):
        ins = _instruction(number, line)
        if ins.keyword == "ARG" and not stages:
            global_args.update(parse_assignments(ins.text, global_args, allow_bare=True))
            global_args.update({k: v for k, v in (build_args or {}).items() if k in global_args})
            continue
        if ins.keyword == "FROM":
            words = ins.text.split()
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                raise DockerfileError(f"line {number}: FROM IMAGE [AS NAME]")
            base = substitute(words[0], global_args)
            if not base:
                raise DockerfileError(f"line {number}: FROM an empty image name")
            stages.append(Stage(base, words[2] if len(words) == 3 else None))
            continue
        if not stages:
            raise DockerfileError(f"line {number}: {ins.keyword} before FROM")
        stages[-1].instructions.append(ins)
    if not stages:
        raise DockerfileError("no FROM")
    return Dockerfile(global_args, stages)


# ---------------------------------------------------------------------------- readings


def seconds(duration: str | float) -> float:
    """A Docker or compose duration (``10s``, ``1m30s``, ``600s``, or a number) in seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", duration)
    if parts is None or not duration:
        raise DockerfileError(f"bad duration {duration!r}")
    h, m, s = parts.groups()
    return int(h or 0) * 3600 + int(m or 0) * 60 + float(s or 0)


def healthcheck_argv(ins: Instruction) -> list[str] | None:
    """The command of ``HEALTHCHECK [flags] CMD ...``; None for ``HEALTHCHECK NONE``."""
    keyword, _, rest = ins.text.partition(" ")
    if keyword.upper() == "NONE":
        return None
    if keyword.upper() != "CMD" or not rest.strip():
        raise DockerfileError(f"line {ins.line}: HEALTHCHECK needs CMD or NONE")
    rest = rest.strip()
    if rest.startswith("["):
        argv = _instruction(ins.line, f"CMD {rest}").exec_form
        assert argv is not None
        return argv
    return ["/bin/sh", "-c", rest]


def run_argv(stage: Stage) -> list[str]:
    """ENTRYPOINT + CMD of ``stage`` (both exec form; shell form is reported elsewhere)."""
    argv: list[str] = []
    for keyword in ("ENTRYPOINT", "CMD"):
        ins = stage.last(keyword)
        if ins is not None and ins.exec_form is not None:
            argv += ins.exec_form
    return argv


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a RUN line (split at && || ; | outside quotes), each as words."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def exposed(stage: Stage) -> set[int]:
    """The ports of the EXPOSE lines of ``stage``."""
    return {int(w.split("/")[0]) for ins in stage.all("EXPOSE") for w in ins.words()}


# ---------------------------------------------------------------------------- .dockerignore


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Go's filepath.Match plus ``**`` (any number of directories), as Docker matches."""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            if pattern.startswith("**/", i):
                out.append("(?:.*/)?")
                i += 3
            else:
                out.append(".*")
                i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith(("!", "^")) else body) + "]")
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


@dataclass(frozen=True)
class DockerIgnore:
    patterns: tuple[tuple[bool, re.Pattern[str], str], ...]  # (negated, regex, cleaned text)

    @classmethod
    def parse(cls, text: str) -> DockerIgnore:
        patterns = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            cleaned = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            patterns.append((negated, _pattern_regex(cleaned), cleaned))
        return cls(tuple(patterns))

    def excluded(self, path: str) -> bool:
        """Whether ``path`` (relative, '/'-separated) is left out of the build context: the last
        pattern matching it or one of its parent directories decides."""
        parts = path.strip("/").split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        result = False
        for negated, regex, _ in self.patterns:
            if any(regex.match(p) for p in prefixes):
                result = not negated
        return result

    def context_files(self, root: Path) -> list[str]:
        """Every file ``docker build root`` would send, relative and '/'-separated."""
        negations = [text for negated, _, text in self.patterns if negated]
        files = []
        for directory, dirnames, filenames in os.walk(root):
            rel_dir = Path(directory).relative_to(root).as_posix()
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            # Skip an excluded directory unless a negation pattern could re-include below it.
            dirnames[:] = [
                d
                for d in dirnames
                if not self.excluded(rel_dir + d)
                or any("**" in n or n.startswith(rel_dir + d + "/") for n in negations)
            ]
            files += [rel_dir + f for f in filenames if not self.excluded(rel_dir + f)]
        return sorted(files)


def glob_context(root: Path, pattern: str) -> list[str]:
    """Context paths a COPY source names (files and directories; wildcards as Go's Match)."""
    pattern = os.path.normpath(pattern).lstrip("/")
    if pattern in ("", "."):
        return ["."]
    if not any(ch in pattern for ch in "*?["):
        return [pattern] if (root / pattern).exists() else []
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.glob(pattern)
        if fnmatch.fnmatchcase(p.relative_to(root).as_posix(), pattern)
    )
