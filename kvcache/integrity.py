"""The error KV bookkeeping checks raise: an inconsistency (a bug), never bad input.

Checks are explicit `if ...: raise IntegrityError(...)`, not `assert`, so that `python -O` keeps
them: `/microserving/stats?check=1` must not answer "ok" because checks were compiled away.
It subclasses AssertionError, which is what such a failure means.
"""


class IntegrityError(AssertionError):
    """Pages, refcounts, the prefix cache or the request registries disagree."""
