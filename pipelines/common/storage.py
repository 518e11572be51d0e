"""Where the job reads and writes: URIs become pyarrow filesystems (S3, GCS, local), input
files are listed, and output files are written so that a reader never sees half of one.

S3 goes through pyarrow's S3FileSystem built here, because pyarrow does not read
AWS_ENDPOINT_URL by itself. Credentials come from the AWS SDK's standard chain (environment,
profile, instance role) inside pyarrow; this module never reads, prints or logs them.

Storage that refuses or drops requests for a while is ridden out at two levels. The AWS SDK
retries each request (pyarrow's default: 3 attempts, waits of up to 1 s and 2 s, about 1.5 s
in all; a larger retry_strategy would be lost anyway when Ray pickles the filesystem to its
workers). The job's own storage operations below are retried whole, with exponential
backoff, for up to MIST_STORAGE_RETRY_S seconds (60) in all. Ray Data's reads of the input
have their own retries (DataContext.retried_io_errors: 10 attempts)."""
from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import os
import posixpath
import re
import threading
import time
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .errors import ConfigError

_COMPRESSION = (".gz", ".bz2", ".zst", ".lz4", ".br")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
RETRY_ENV = "MIST_STORAGE_RETRY_S"
# How pyarrow words errors worth retrying (the AWS SDK's error names, curl's, GCS's). A
# missing file, a denied request or a broken file is not one: retrying cannot fix it.
_TRANSIENT = re.compile(r"NETWORK_CONNECTION|SERVICE_UNAVAILABLE|SLOW_DOWN|INTERNAL_FAILURE|"
                        r"REQUEST_TIME_?OUT|THROTTLING|HTTP status 5\d\d|curlCode|"
                        r"connection (reset|refused|closed)|timed out|Unavailable|"
                        r"DeadlineExceeded", re.IGNORECASE)
_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
log = logging.getLogger("pipelines.common.storage")
_retrying = threading.local()


def redact(uri: str) -> str:
    """A URI fit for logs and the manifest: any user:password@ part is removed."""
    parts = urlsplit(uri)
    if parts.scheme and "@" in parts.netloc:
        return uri.replace(parts.netloc, "***@" + parts.netloc.rsplit("@", 1)[1], 1)
    return uri


def retry_seconds() -> float:
    return float(os.environ.get(RETRY_ENV) or 60)


def transient(e: BaseException) -> bool:
    """A storage error that may go away by itself: the endpoint unreachable, a connection
    dropped, a 5xx or throttling answer."""
    return isinstance(e, OSError) and not isinstance(
        e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
            NotADirectoryError)) and bool(_TRANSIENT.search(str(e)))


# What S3 (AWS Error ACCESS_DENIED, InvalidAccessKeyId, SignatureDoesNotMatch, …) and GCS
# (PERMISSION_DENIED, UNAUTHENTICATED) answer to credentials that are missing, wrong or
# without the permission.
_DENIED = re.compile(r"ACCESS_DENIED|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|"
                     r"InvalidToken|ExpiredToken|PERMISSION_DENIED|UNAUTHENTICATED|"
                     r"\b40[13]\b|Forbidden|[Pp]ermission denied")


def denied(e: BaseException) -> bool:
    """A storage error that says this machine may not read or write there: retrying will
    not help, the credentials or the permissions must change."""
    return isinstance(e, PermissionError) or (
        isinstance(e, OSError) and not transient(e) and bool(_DENIED.search(str(e))))


def retried(fn):
    """Run `fn` again on a transient storage error, with exponential backoff, for up to
    retry_seconds() in all; `fn` must be safe to repeat. Nested retried calls share the
    outermost call's budget instead of multiplying it."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_retrying, "active", False):
            return fn(*args, **kwargs)
        _retrying.active = True
        try:
            deadline, delay = time.monotonic() + retry_seconds(), 0.5
            while True:
                try:
                    return fn(*args, **kwargs)
                except OSError as e:
                    if not transient(e) or time.monotonic() + delay > deadline:
                        raise
                    log.warning("storage error, retrying in %.1fs: %s", delay, one_line(e))
                    time.sleep(delay)
                    delay = min(2 * delay, 10.0)
        finally:
            _retrying.active = False
    return wrapper


@contextlib.contextmanager
def once():
    """Storage calls made inside run once: a retried function called here is not retried
    (it sees an outer call holding the budget). For best-effort work on the way out of a
    failed run, which must not add the retry time to an outage's."""
    outer = getattr(_retrying, "active", False)
    _retrying.active = True
    try:
        yield
    finally:
        _retrying.active = outer


def one_line(e: BaseException) -> str:
    """An error's first line, with any credential of the environment masked."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    for name in _SECRETS:
        value = os.environ.get(name)
        if value:
            text = text.replace(value, "***")
    return text


def s3_endpoint() -> tuple[str | None, str | None]:
    """(endpoint URL, region) for S3: the endpoint of AWS_ENDPOINT_URL_S3 or
    AWS_ENDPOINT_URL (MinIO, moto, …), None for AWS itself. An endpoint with a
    `user:password@` part is refused: pyarrow would take it for a host name (and fail as a
    storage outage, the user name in its message); S3 credentials travel in the AWS chain,
    not the URL. The message names the variable, never its value."""
    name = next((n for n in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(n)),
                None)
    endpoint = os.environ[name] if name else None
    if endpoint and "@" in (urlsplit(endpoint).netloc if "//" in endpoint else endpoint):
        raise ConfigError(f"{name} holds a user name or password (user:password@host): give "
                          "the endpoint as scheme://host:port and the credentials as "
                          "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile)")
    # Without a region the SDK would probe EC2 metadata, which a custom endpoint never needs.
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return endpoint, (region or "us-east-1") if (region or endpoint) else None


def s3_filesystem() -> pafs.S3FileSystem:
    """S3 with the endpoint of AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (s3_endpoint)."""
    endpoint, region = s3_endpoint()
    kwargs = {}
    if endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme:
            kwargs.update(scheme=parts.scheme, endpoint_override=parts.netloc)
        else:
            kwargs["endpoint_override"] = endpoint
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, path within it, prefix that turns such a path back into a URI)."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "s3":
        return s3_filesystem(), _bucket_path(uri), "s3://"
    if scheme in ("gs", "gcs"):
        limit = dt.timedelta(seconds=retry_seconds())
        return pafs.GcsFileSystem(retry_time_limit=limit), _bucket_path(uri), "gs://"
    if scheme == "file":
        return pafs.LocalFileSystem(), os.path.abspath(parts.path), ""
    if scheme and len(scheme) > 1:  # one letter: a Windows drive, not a scheme
        raise ValueError(f"unsupported URI scheme {scheme!r} in {redact(uri)}: use s3://, gs://, "
                         "file://, hf:// or a local path")
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri)), ""


# Set by Ray in the environment of a driver that `ray job submit` started (the job's
# runtime environment and metadata, as JSON). Such a driver runs in Ray's unpacked copy of
# --working-dir (or the job agent's folder), not where the command was typed.
JOB_SUBMIT_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def under_job_submit() -> bool:
    """Whether this process is the driver of a job started by `ray job submit`."""
    return JOB_SUBMIT_ENV in os.environ


def relative_path(uri: str) -> bool:
    """Whether `uri` is a local path that depends on the current folder: no scheme, not
    absolute, not ~ (file:name without slashes too)."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return not parts.netloc and not parts.path.startswith("/")
    if scheme and len(scheme) > 1:  # s3://, gs://, hf://, …
        return False
    return not os.path.isabs(os.path.expanduser(uri))


def _bucket_path(uri: str) -> str:
    parts = urlsplit(uri)
    bucket = parts.netloc.rsplit("@", 1)[-1]
    if not bucket:
        raise ValueError(f"{redact(uri)} names no bucket")
    return (bucket + "/" + parts.path.lstrip("/")).rstrip("/")


def join(*parts: str) -> str:
    return posixpath.join(*parts)


def detect_format(path: str) -> str | None:
    """'jsonl' or 'parquet' from a file name (compression suffixes ignored), else None."""
    name = path.lower()
    for suffix in _COMPRESSION:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def _hidden(path: str, root: str) -> bool:
    rel = posixpath.relpath(path, root) if path != root else posixpath.basename(path)
    return any(p.startswith((".", "_")) for p in rel.split("/"))


@retried
def list_files(fs: pafs.FileSystem, root: str) -> list[str]:
    """Every visible file under a directory (none of its path parts starting with '.' or
    '_', as Spark, Ray and pyarrow skip them), sorted; [] if it does not exist."""
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        return []
    if info.type == pafs.FileType.File:
        return [root]
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    return sorted(i.path for i in infos
                  if i.type == pafs.FileType.File and not _hidden(i.path, root))


@retried
def input_files(uri: str, fmt: str = "auto") -> tuple[pafs.FileSystem, list[tuple[str, str]], str]:
    """The data files of one input URI as (path, format), in name order, with their
    filesystem and URI prefix. A file named directly is taken whatever its name; in a
    directory, `auto` keeps the .jsonl/.json/.ndjson/.parquet files (compressed or not)."""
    fs, root, prefix = filesystem(uri)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"input not found: {redact(uri)}")
    if info.type == pafs.FileType.File:
        found = fmt if fmt != "auto" else detect_format(root)
        if found is None:
            raise ValueError(f"cannot tell the format of {redact(uri)} from its name: "
                             "pass --format jsonl or --format parquet")
        files = [(root, found)]
    else:
        files = []
        for path in list_files(fs, root):
            found = detect_format(path) if fmt == "auto" else fmt
            if found is not None:
                files.append((path, found))
    if not files:
        raise FileNotFoundError(f"no .jsonl, .json, .ndjson or .parquet files under {redact(uri)}")
    check_readable(fs, [path for path, _ in files], prefix)
    return fs, files, prefix


def check_readable(fs: pafs.FileSystem, paths: list[str], prefix: str = "") -> None:
    """Fail now, not in a read task after the model has loaded, where an input cannot be
    read: every local file's permission; on object storage the first file's first byte
    (the credentials and the bucket's permissions, which as a rule hold for the rest).

    Raises:
        PermissionError: a local file this process may not read.
        OSError: the storage's refusal (see `denied`).
    """
    if isinstance(fs, pafs.LocalFileSystem):
        bad = next((p for p in paths if not os.access(p, os.R_OK)), None)
        if bad is not None:
            raise PermissionError(f"cannot read input {bad}")
        return
    with fs.open_input_stream(paths[0]) as f:
        f.read(1)


@retried
def write_atomic(fs: pafs.FileSystem, path: str, data: bytes | pa.Table) -> None:
    """Write a file under a hidden temporary name, then move it into place: readers skip
    '_' names, so they see the whole file or none of it."""
    parent, name = posixpath.split(path)
    fs.create_dir(parent, recursive=True)
    tmp = join(parent, "_tmp-" + name)
    if isinstance(data, pa.Table):
        pq.write_table(data, tmp, filesystem=fs)
    else:
        with fs.open_output_stream(tmp) as f:
            f.write(data)
    fs.move(tmp, path)


@retried
def read_text(fs: pafs.FileSystem, path: str) -> str | None:
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return f.read().decode("utf-8")


@retried
def parquet_schema(fs: pafs.FileSystem, root: str) -> tuple[list[str], pa.Schema | None]:
    """The parquet files under a directory and their unified schema (None if no files):
    files written by different runs may have different extra columns."""
    files = [p for p in list_files(fs, root) if p.endswith(".parquet")]
    if not files:
        return files, None
    return files, pa.unify_schemas([pq.read_schema(p, filesystem=fs) for p in files],
                                   promote_options="permissive")


@retried
def read_parquet_dir(fs: pafs.FileSystem, root: str, columns: list[str] | None = None) -> pa.Table | None:
    """All parquet files under a directory as one table (a column missing from a file reads
    as null), None if there are none."""
    files, schema = parquet_schema(fs, root)
    if not files:
        return None
    return pads.dataset(files, schema=schema, format="parquet", filesystem=fs).to_table(columns=columns)


@retried
def read_jsonl_dir(fs: pafs.FileSystem, root: str) -> list[str]:
    """Every line of every .jsonl file under a directory (no parsing)."""
    lines = []
    for path in list_files(fs, root):
        if path.endswith(".jsonl"):
            with fs.open_input_stream(path) as f:
                lines += [ln for ln in f.read().decode("utf-8").splitlines() if ln.strip()]
    return lines
