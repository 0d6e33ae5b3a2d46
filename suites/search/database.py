"""A campaign's shared Hypothesis example database: a directory on one
machine or a Redis server for workers on several; opened and checked before
any worker starts, and a database that goes away mid-campaign reported
while the workers go on in memory."""

from pathlib import Path
from typing import Callable, Optional


REDIS_PREFIX = b"kvparity-example:"
# A Redis server that stops answering fails a call after this, not never.
REDIS_TIMEOUT_S = 10


class DatabaseError(Exception):
    """The --database given cannot be used as written (a usage error)."""


class DatabaseUnavailable(Exception):
    """The database cannot be reached or opened here (cannot judge)."""


def open_database(spec: Optional[str]):
    """The example database ``spec`` names: None for none, ``redis://...``
    for a Redis server, anything else a directory."""
    if spec is None:
        return None
    if spec.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError as error:
            raise DatabaseUnavailable(f"--database {spec}: needs the redis package "
                                      f"(pip install 'kvparity[redis]'): {error}")
        try:
            client = redis.Redis.from_url(spec, socket_timeout=REDIS_TIMEOUT_S,
                                          socket_connect_timeout=REDIS_TIMEOUT_S)
        except ValueError as error:
            raise DatabaseError(f"--database {spec}: not a Redis URL: {error}")
        return RedisExampleDatabase(client, key_prefix=REDIS_PREFIX)
    if "://" in spec:
        raise DatabaseError(f"--database {spec}: a directory or redis://host:port[/db]")
    from hypothesis.database import DirectoryBasedExampleDatabase

    path = Path(spec)
    if path.exists() and not path.is_dir():
        raise DatabaseError(f"--database {spec}: not a directory")
    return DirectoryBasedExampleDatabase(path)


def check_database(spec: Optional[str]):
    """Open ``spec`` and, for Redis, reach the server: refused before any worker starts."""
    database = open_database(spec)
    if database is not None and hasattr(database, "redis"):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        try:  # one try: the workers' own client retries, the check need not
            redis.Redis.from_url(spec, retry=Retry(NoBackoff(), 0)).ping()
        except redis.RedisError as error:
            raise DatabaseUnavailable(f"--database {spec}: cannot reach the server: {error}")
    return database


def database_errors() -> tuple:
    """What a database that went away raises: OSError for a directory, and
    Redis's errors where the redis package is installed."""
    try:
        import redis
    except ImportError:
        return (OSError,)
    return (OSError, redis.RedisError)


def fallible(database, spec: str, lost: Callable[[str], None]):
    """``database`` that, should it fail, says so once through ``lost`` and
    from then on keeps the worker's examples in memory."""
    from hypothesis.database import ExampleDatabase, InMemoryExampleDatabase

    class FallibleDatabase(ExampleDatabase):
        def __init__(self):
            super().__init__()
            self.memory, self.gone = InMemoryExampleDatabase(), False

        def _call(self, name, *args):
            if not self.gone:
                try:
                    return list(getattr(database, name)(*args) or ())
                except database_errors() as error:
                    self.gone = True
                    lost(f"the example database {spec} went away ({type(error).__name__}: {error}); "
                         "from then on the worker kept its examples in memory, so what it found after is "
                         "in this run's report, not in the database")
            return list(getattr(self.memory, name)(*args) or ())

        def fetch(self, key):
            yield from self._call("fetch", key)

        def save(self, key, value):
            self._call("save", key, value)

        def delete(self, key, value):
            self._call("delete", key, value)

        def move(self, src, dest, value):
            self._call("move", src, dest, value)

    return FallibleDatabase()


def database_key(level: str, implementation: str) -> bytes:
    """The key of one machine's examples: a failure replays on the same
    level and implementation (a control's failures never reach the
    reference's campaign, where a pass would delete them)."""
    return f"kvparity fuzz {level} {implementation}".encode()
