"""User-facing errors. Each message is one line: the field, what is wrong, and the fix."""

from __future__ import annotations

import difflib

# Exit codes, one meaning each, the same for every command (README "Exit codes", every --help).
EXIT_OK = 0  # done; the plan fits; every check passed
EXIT_FAILED = 1  # does not fit, or a check failed (the run's contract, accept's verdict, verify-resume)
EXIT_BAD_INPUT = 2  # bad input: one line naming the field and the fix, nothing written
EXIT_STOPPED = 3  # stopped before the end, resumable: interrupted (Ctrl-C, SIGTERM), or the stability guard
EXIT_INTERNAL = 4  # an internal error, a bug: one line, the traceback saved to a file
EXIT_CODES_HELP = (
    "exit codes: 0 done / fits / passed; 1 does not fit, or a check failed; 2 bad input (one line naming "
    "the field and the fix); 3 stopped before the end, resumable from its checkpoint (Ctrl-C, SIGTERM, "
    "the stability guard); 4 internal error (a bug: the traceback is saved to a file)"
)


def in_its_words(e: BaseException, limit: int = 160) -> str:
    """'TypeError: the first line of its message': another library's refusal, quoted on one line."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:limit]}".rstrip(": ")


class TrainplanError(ValueError):
    """A user error: bad input, a refused configuration. The CLI prints it on one line, exit 2."""


class ConfigError(TrainplanError):
    """A configuration field is invalid."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field = field
        super().__init__(f"{field}: {problem}; {fix}")


class NotRunnable(ConfigError):
    """A configuration the planner covers but the training engine does not run; `what` names the
    missing capability in a few words (advise shows it beside the entry)."""

    def __init__(self, field: str, problem: str, fix: str, *, what: str):
        self.what = what
        super().__init__(field, problem, fix)

    @classmethod
    def beside(cls, field: str, what: str, layout: str, fix: str) -> NotRunnable:
        """A feature (`what`, its reason in parentheses) the engine has not run under a layout ("tensor
        parallelism"), though the planner plans the two together."""
        return cls(
            field,
            f"{what} under {layout} is planned, and the engine does not run the two together",
            fix,
            what=f"{what.split(' (')[0]} with {layout}",
        )


class ConfigErrors(ConfigError):
    """Several configuration fields are invalid: one line each, all found before any is reported."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = errors
        self.field = errors[0].field
        ValueError.__init__(self, "\n".join(str(e) for e in errors))


def nearest(name: str, choices: list[str] | tuple[str, ...], n: int = 3) -> str:
    """'did you mean ...' text for an unknown name (case-insensitive)."""
    lowered = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.4)
    if hits:
        return "did you mean " + " or ".join(repr(lowered[h]) for h in hits) + "?"
    if len(choices) <= 5:
        return "choose one of " + ", ".join(sorted(choices))
    closest = difflib.get_close_matches(name.lower(), list(lowered), n=5, cutoff=0.0)
    return f"the closest of {len(choices)} are " + ", ".join(lowered[h] for h in closest)
