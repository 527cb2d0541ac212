"""User-facing errors: one clear line, exit code 2, no traceback."""


class UserError(Exception):
    """Bad input from the user (recipe, candidate, data). The CLI prints `error: <message>` and exits 2."""


class RecipeError(UserError):
    """A recipe that does not parse or validate; the message names the file and the key."""


class CandidateError(UserError):
    """A candidate that cannot be loaded or does not satisfy its slot's contract."""


class DataError(UserError):
    """Text or tokenizer that cannot be found or read."""


class OutputError(CandidateError):
    """What a candidate hands training is not what was checked: an output that is more than a plain tensor, one
    that its next call overwrites, or a hook or gradient it changed beyond its outputs."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception in one line for a message: its type's name and its text's first line, or "(no message)" where
    it has none, so that no message ends in an empty reason; at most `limit` characters."""
    text = str(e).strip()
    said = f"{type(e).__name__}: {text.splitlines()[0]}" if text else f"{type(e).__name__} (no message)"
    return said[:limit]
