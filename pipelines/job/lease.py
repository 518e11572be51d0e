"""One writer per output: a run takes a lease on its --output before it writes anything and
gives it back at its end, so that a second run onto the same output (a scheduled refresh
overlapping a slow one) refuses at once instead of writing every row a second time.

- A local folder: an exclusive lock (flock) on `<output>/_lease.json`, which also holds the
  holder's record. The kernel releases the lock when its process dies, however it dies, so a
  crashed run never blocks the next one.
- S3: the object `<output>/_lease.json`, created with a conditional put (`If-None-Match: *`,
  the primitive Delta Lake and Iceberg build their commits on) and renewed every quarter of
  its time to live with `If-Match` on its own ETag. A lease whose holder is gone may be taken
  over, again with `If-Match` on the ETag read, so of two runs taking over one lease only
  one succeeds: gone means not renewed for its time to live (MIST_LEASE_TTL_S, 300 s; the
  age by the server's clock), or held by a process of this host that no longer exists (a
  driver killed on this machine is taken over at once).
- Other object stores (gs://): the same record through pyarrow, which has no conditional
  write: checked, written and read back, which keeps out a run that starts while another
  holds the lease but not two that start within the same instant.

The manifest is written only while the lease is held (Lease.check, after the counts
reconcile): a run whose lease was taken over (it stopped renewing it for longer than its
time to live) fails without a manifest."""
from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import os
import socket
import threading

import pyarrow.fs as pafs

from ..common import storage
from ..common.errors import AccountingError, ConfigError, OutputBusy

LEASE = "_lease.json"
TTL_ENV = "MIST_LEASE_TTL_S"
log = logging.getLogger("pipelines.lease")
_held: set[str] = set()  # run ids whose lease this process holds


def ttl_seconds() -> float:
    return float(os.environ.get(TTL_ENV) or 300)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _record(run_id: str, ttl: float | None) -> dict:
    return {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
            "started_at": _now().isoformat(timespec="seconds"), "ttl_s": ttl,
            "renewed_at": _now().isoformat(timespec="seconds")}


def _process_gone(rec: dict) -> bool:
    """Whether the holder was a process of this host that is no longer there (or this
    process, for a run that ended without giving its lease back)."""
    if rec.get("host") != socket.gethostname() or not isinstance(rec.get("pid"), int):
        return False
    if rec["pid"] == os.getpid():
        return rec.get("run_id") not in _held
    try:
        os.kill(rec["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's live process
        return False
    return False


def _holder(rec: dict | None) -> str:
    if not rec:
        return "another run"
    return (f"run {rec.get('run_id')} (pid {rec.get('pid')} on {rec.get('host')}, "
            f"started {rec.get('started_at')})")


def _local(out) -> bool:
    return isinstance(out.fs, pafs.LocalFileSystem)


def acquire(out, run_id: str) -> LocalLease | ObjectLease:
    """Take the lease on the output `out` (job.output.Output) for this run, or raise
    OutputBusy (one line: who holds it and how to take over)."""
    lease = LocalLease(out, run_id) if _local(out) else ObjectLease(out, run_id)
    _held.add(run_id)  # first: a run of this process holding it is not a gone process
    try:
        lease.acquire()
    except BaseException:
        _held.discard(run_id)
        raise
    return lease


class LocalLease:
    def __init__(self, out, run_id: str):
        self.out, self.run_id, self.path = out, run_id, out.path(LEASE)
        self.fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        while True:
            try:
                os.makedirs(self.out.root, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ConfigError(f"cannot write {self.out.display(LEASE)}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise ConfigError(f"cannot lock {self.out.display(LEASE)} ({e.strerror}): "
                                      "the output's filesystem does not support locks") from None
                raise OutputBusy(
                    f"{self.out.display()} is being written by {_holder(self._read())}: wait "
                    "for it to finish or stop it (a run that has died holds no lock)") from None
            # The holder before us may have deleted the file between our open and our lock:
            # a lock on a file no longer at the path guards nothing, so start again.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_record(self.run_id, None)).encode("utf-8"), 0)
        self.fd = fd

    def _read(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.loads(f.read() or "null")
        except (OSError, ValueError):
            return None

    def check(self) -> None:
        """The lock cannot be lost while this process holds it."""

    def release(self) -> None:
        if self.fd is None:
            return
        _held.discard(self.run_id)
        try:
            os.unlink(self.path)  # before unlocking: a waiting run then locks a new file
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


class ObjectLease:
    """A lease object in a bucket, renewed by a thread while the run goes on."""

    def __init__(self, out, run_id: str):
        self.out, self.run_id = out, run_id
        self.ttl = ttl_seconds()
        self.store = (_S3Store if out.prefix == "s3://" else _PlainStore)(out.fs, out.path(LEASE))
        self.version: str | None = None
        self.lost: str | None = None  # why the lease is no longer ours
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _ttl(self, rec: dict | None) -> float:
        """The holder's time to live: its renewals keep to its own setting, not ours."""
        ttl = (rec or {}).get("ttl_s")
        return float(ttl) if isinstance(ttl, (int, float)) else self.ttl

    def _body(self, started: str | None = None) -> bytes:
        rec = _record(self.run_id, self.ttl)
        if started:
            rec["started_at"] = started
        return json.dumps(rec).encode("utf-8")

    @storage.retried
    def acquire(self) -> None:
        self.started = _now().isoformat(timespec="seconds")
        # Read first: most runs find no lease, and one that finds a live one needs its record.
        rec, version, age = self.store.read()
        if rec is None:
            self.version = self.store.create(self._body(self.started))
        if self.version is None:
            if rec is None:  # created by another run since our read
                rec, version, age = self.store.read()
            if rec is None:  # ... and given back already: try once more
                self.version = self.store.create(self._body(self.started))
            elif rec.get("run_id") == self.run_id:  # ours: a retried create whose answer was lost
                self.version = version
            elif age >= self._ttl(rec) or _process_gone(rec):
                log.info("taking over the lease of %s on %s (%s)", _holder(rec),
                         self.out.display(), "its process is gone" if _process_gone(rec)
                         else f"not renewed for {age:.0f}s")
                self.version = self.store.replace(self._body(self.started), version)
            if self.version is None:
                rec, _, age = self.store.read()
                left = max(0, self._ttl(rec) - age)
                raise OutputBusy(
                    f"{self.out.display()} is being written by {_holder(rec)}, its lease renewed "
                    f"{age:.0f}s ago: wait for it to finish; if it is no longer running, delete "
                    f"{self.out.display(LEASE)} and rerun (its lease lapses by itself in "
                    f"{left:.0f}s)")
        self._thread = threading.Thread(target=self._renew, daemon=True, name="mist-lease")
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                version = self.store.replace(self._body(self.started), self.version)
            except Exception as e:  # a storage hiccup: the next renewal may get through
                log.warning("could not renew the lease on %s: %s", self.out.display(),
                            storage.one_line(e))
                continue
            if version is None:
                self.lost = f"another run took over {self.out.display(LEASE)}"
                log.error("%s: this run will not write a manifest", self.lost)
                return
            self.version = version

    def check(self) -> None:
        """Raise unless this run still holds the lease: the manifest is the holder's."""
        rec, version, _ = self.store.read()
        if self.lost is None and (rec or {}).get("run_id") != self.run_id:
            self.lost = f"{self.out.display(LEASE)} is held by {_holder(rec)}"
        if self.lost:
            raise AccountingError(f"{self.lost} (this run's lease lapsed: not renewed for "
                                  f"{self.ttl:.0f}s); the output has no manifest from this "
                                  "run: check what the other run wrote, then rerun")

    def release(self) -> None:
        """Give the lease back, once and without retries: a run that fails on a storage
        outage must not wait longer for it (the next run on this host takes the lease over,
        any other once it lapses)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        _held.discard(self.run_id)
        if self.version is None or self.lost:
            return
        try:
            self.store.delete(self.version)
        except Exception as e:
            log.warning("could not give back the lease on %s (%s): it lapses in %.0fs",
                        self.out.display(), storage.one_line(e), self.ttl)


class _S3Store:
    """The lease object through boto3: pyarrow's S3 filesystem has no conditional put."""

    def __init__(self, fs, path: str):
        import boto3
        from botocore.config import Config

        self.bucket, self.key = path.split("/", 1)
        endpoint, region = storage.s3_endpoint()
        self.client = boto3.client(
            "s3", endpoint_url=endpoint, region_name=region,
            config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5,
                          read_timeout=20))

    def _call(self, name: str, **kwargs):
        """The request, None if its condition failed (412), or an error the job's policy
        knows: ConfigError for a bucket that is not there or a request S3 refuses, an
        OSError that storage.transient retries for an outage."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, name)(Bucket=self.bucket, Key=self.key, **kwargs)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return None
            if code in ("NoSuchKey", "404") and name == "get_object":
                return None
            if code == "NoSuchBucket":
                raise ConfigError(f"the output bucket {self.bucket} does not exist: create it "
                                  "or choose another --output") from None
            if status >= 500 and code != "NotImplemented" or code in ("SlowDown", "Throttling"):
                raise OSError(f"{code}: HTTP status {status} from S3 ({name})") from None
            raise ConfigError(f"S3 refused the output's lease ({name} s3://{self.bucket}/"
                              f"{self.key}): {code} (the lease needs conditional writes, "
                              "If-None-Match and If-Match)") from None
        except BotoCoreError as e:  # no connection, a timeout: an outage, retried
            raise OSError(f"connection refused or timed out: {e}") from None

    def create(self, body: bytes) -> str | None:
        r = self._call("put_object", Body=body, IfNoneMatch="*")
        return r and r["ETag"]

    def replace(self, body: bytes, version: str) -> str | None:
        r = self._call("put_object", Body=body, IfMatch=version)
        return r and r["ETag"]

    def read(self) -> tuple[dict | None, str | None, float]:
        """(record, ETag, seconds since it was written by the server's clock)."""
        r = self._call("get_object")
        if r is None:
            return None, None, 0.0
        served = r["ResponseMetadata"]["HTTPHeaders"].get("date")
        now = dt.datetime.strptime(served, "%a, %d %b %Y %H:%M:%S GMT").replace(
            tzinfo=dt.timezone.utc) if served else _now()
        try:
            rec = json.loads(r["Body"].read())
        except ValueError:
            rec = {}
        return rec, r["ETag"], (now - r["LastModified"]).total_seconds()

    def delete(self, version: str) -> None:
        try:
            self._call("delete_object", IfMatch=version)
        except ConfigError:  # a store without conditional deletes: delete it if still ours
            rec, etag, _ = self.read()
            if etag == version:
                self._call("delete_object")


class _PlainStore:
    """The lease file through a pyarrow filesystem without conditional writes: the version
    is the file's text, compared before each write."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def read(self) -> tuple[dict | None, str | None, float]:
        info = self.fs.get_file_info(self.path)
        text = storage.read_text(self.fs, self.path)
        if text is None:
            return None, None, 0.0
        age = (_now() - info.mtime).total_seconds() if info.mtime else 0.0
        try:
            return json.loads(text), text, age
        except ValueError:
            return {}, text, age

    def _write(self, body: bytes) -> str | None:
        storage.write_atomic(self.fs, self.path, body)
        _, version, _ = self.read()
        return version if version == body.decode("utf-8") else None

    def create(self, body: bytes) -> str | None:
        return None if self.read()[0] is not None else self._write(body)

    def replace(self, body: bytes, version: str) -> str | None:
        return self._write(body) if self.read()[1] == version else None

    def delete(self, version: str) -> None:
        if self.read()[1] == version:
            self.fs.delete_file(self.path)
