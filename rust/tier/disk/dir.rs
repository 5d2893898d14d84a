//! A namespace directory as the disk tier owns it: one owner at a time, nothing followed,
//! nothing shared, metadata replaced atomically.
//!
//! - **One owner.** [`TierDir::open`] takes an exclusive `flock` on [`LOCK_FILE`] and holds it
//!   for the tier's life (released by the kernel when the descriptor closes, crash included).
//!   `flock` locks belong to the open file description, so a second opener in the same
//!   process conflicts as one in another process does. The owner writes `pid=N` into the lock
//!   file; a refused opener reads it to name the holder ([`Error::TierInUse`]). Readers
//!   (`kvoffload disk inspect|verify`) take a shared lock ([`reader_lock`]): they never see
//!   a writer's half-written batch, and an engine opening meanwhile is told the directory is
//!   in use.
//! - **Nothing followed.** Every file of the directory is opened relative to the directory's
//!   own descriptor (`openat`) with `O_NOFOLLOW`, and the directory itself with
//!   `O_DIRECTORY | O_NOFOLLOW`: a symbolic link in place of the directory, the slab file, the
//!   layout note or the lock file is refused ([`Error::TierPath`], naming the path), as is a
//!   file that is not a regular one, one with another hard link (writing it would change a
//!   file outside the tier), or one owned by another user.
//! - **Owner-only.** Directories are created `0700` and files `0600`; ours found with wider
//!   permissions are narrowed.
//! - **Atomic metadata.** [`TierDir::replace`] writes a new file beside the old one
//!   (`O_CREAT | O_EXCL`), fsyncs it, renames it over the old one and fsyncs the directory:
//!   a crash leaves the old file or the new one, never a torn one.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Name of the lock file of a namespace directory.
pub const LOCK_FILE: &str = "lock";

/// A namespace directory held by this process: its descriptor and its locked lock file.
#[derive(Debug)]
pub struct TierDir {
    path: PathBuf,
    dir: File,
    lock: File,
}

fn c_name(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))
}

/// `openat(dir, name, flags | O_NOFOLLOW | O_CLOEXEC, mode)`.
fn open_at(dir: &File, name: &str, flags: libc::c_int, mode: libc::mode_t) -> io::Result<File> {
    let c = c_name(name)?;
    #[allow(unsafe_code)]
    // SAFETY: `c` is a NUL-terminated string alive for the call; the descriptor returned is
    // owned by the `File` made from it and by nothing else.
    unsafe {
        let fd = libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            libc::c_uint::from(mode),
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(File::from_raw_fd(fd))
    }
}

/// The error of a path the tier refuses.
fn refused(path: &Path, reason: impl Into<String>) -> Error {
    Error::TierPath {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// The error of a failed open of `path`: a symbolic link (or, for a directory, anything that is
/// not one) is refused by name; anything else is an I/O error.
fn open_error(path: &Path, e: &io::Error, dir: bool) -> Error {
    match e.raw_os_error() {
        Some(libc::ELOOP) => refused(
            path,
            "is a symbolic link; the disk tier never follows one (remove it)",
        ),
        Some(libc::ENOTDIR) if dir => refused(
            path,
            "is not a directory (or is a symbolic link, which the disk tier never follows)",
        ),
        _ => super::slab::io_err(path, "cannot open", e),
    }
}

/// Checks that `f` (at `path`) is ours to use: a regular file (or a directory when `dir`),
/// with no other hard link, owned by this user; narrows its permissions to the owner's.
fn check_owned(f: &File, path: &Path, dir: bool) -> Result<()> {
    let md = f
        .metadata()
        .map_err(|e| super::slab::io_err(path, "cannot stat", &e))?;
    if dir && !md.is_dir() {
        return Err(refused(path, "is not a directory"));
    }
    if !dir && !md.is_file() {
        return Err(refused(path, "is not a regular file"));
    }
    if !dir && md.nlink() > 1 {
        return Err(refused(
            path,
            format!(
                "has {} hard links; writing it would change a file outside the tier (remove it)",
                md.nlink()
            ),
        ));
    }
    #[allow(unsafe_code)]
    // SAFETY: a plain syscall without arguments.
    let me = unsafe { libc::geteuid() };
    if md.uid() != me {
        return Err(refused(
            path,
            format!("is owned by uid {}, not by this user (uid {me})", md.uid()),
        ));
    }
    let want = if dir { 0o700 } else { 0o600 };
    if md.mode() & 0o7777 != want {
        #[allow(unsafe_code)]
        // SAFETY: a plain syscall on an open descriptor.
        if unsafe { libc::fchmod(f.as_raw_fd(), want) } != 0 {
            return Err(super::slab::io_err(
                path,
                "cannot make owner-only",
                &io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}

/// Opens `root` (created `0700` if missing; the caller's path, followed as given) and its
/// subdirectory `name` without following a link; `create` makes the subdirectory (`0700`).
/// `Ok(None)`: `name` does not exist and `create` is false.
fn open_subdir(root: &Path, name: &str, create: bool) -> Result<Option<(PathBuf, File)>> {
    let path = root.join(name);
    if create {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .map_err(|e| super::slab::io_err(root, "cannot create", &e))?;
    }
    let rootf = match File::open(root) {
        Ok(f) => f,
        Err(e) if !create && e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(super::slab::io_err(root, "cannot open", &e)),
    };
    if create {
        let c = c_name(name).map_err(|e| super::slab::io_err(&path, "bad name", &e))?;
        #[allow(unsafe_code)]
        // SAFETY: `c` is a NUL-terminated string alive for the call.
        let r = unsafe { libc::mkdirat(rootf.as_raw_fd(), c.as_ptr(), 0o700) };
        let e = io::Error::last_os_error();
        if r != 0 && e.raw_os_error() != Some(libc::EEXIST) {
            return Err(super::slab::io_err(&path, "cannot create", &e));
        }
    }
    match open_at(&rootf, name, libc::O_RDONLY | libc::O_DIRECTORY, 0) {
        Ok(d) => Ok(Some((path, d))),
        Err(e) if !create && e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(open_error(&path, &e, true)),
    }
}

/// Who holds the lock file `lock` (a refused opener's view), from the `pid=N` its owner wrote.
fn holder(lock: &File) -> String {
    let mut text = String::new();
    let _ = (&*lock).read_to_string(&mut text);
    let pid = text
        .trim()
        .strip_prefix("pid=")
        .and_then(|p| p.parse::<libc::pid_t>().ok());
    match pid {
        Some(pid) if pid == std::process::id() as libc::pid_t => {
            format!("this process (pid {pid}): another tier object opened it first")
        }
        #[allow(unsafe_code)]
        // SAFETY: signal 0 only checks that the process exists.
        Some(pid)
            if unsafe { libc::kill(pid, 0) } == 0
                || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM) =>
        {
            format!("process {pid}")
        }
        _ => "a reader (`kvoffload disk inspect` or `verify`) or an opener that is starting"
            .to_string(),
    }
}

/// `flock(f, op)`; `Ok(false)` when another holder makes it wait.
fn try_flock(f: &File, op: libc::c_int) -> io::Result<bool> {
    loop {
        #[allow(unsafe_code)]
        // SAFETY: a plain syscall on an open descriptor.
        if unsafe { libc::flock(f.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EWOULDBLOCK) => return Ok(false),
            _ => return Err(e),
        }
    }
}

impl TierDir {
    /// Opens (creating it `0700` if needed) the namespace directory `name` under `root` and
    /// takes its lock for as long as the returned value lives. Errors: [`Error::TierInUse`]
    /// while another opener holds it, [`Error::TierPath`] for a symbolic link or a file that is
    /// not ours, [`Error::Io`] for I/O errors; each names the path.
    pub fn open(root: &Path, name: &str) -> Result<Self> {
        let (path, dir) = open_subdir(root, name, true)?.expect("created");
        check_owned(&dir, &path, true)?;
        let lock_path = path.join(LOCK_FILE);
        let lock = open_at(&dir, LOCK_FILE, libc::O_RDWR | libc::O_CREAT, 0o600)
            .map_err(|e| open_error(&lock_path, &e, false))?;
        check_owned(&lock, &lock_path, false)?;
        if !try_flock(&lock, libc::LOCK_EX)
            .map_err(|e| super::slab::io_err(&lock_path, "cannot lock", &e))?
        {
            return Err(Error::TierInUse {
                dir: path.display().to_string(),
                holder: holder(&lock),
            });
        }
        let pid = format!("pid={}\n", std::process::id());
        lock.set_len(0)
            .and_then(|()| lock.write_all_at(pid.as_bytes(), 0))
            .map_err(|e| super::slab::io_err(&lock_path, "cannot write", &e))?;
        Ok(Self { path, dir, lock })
    }

    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the regular file `name` of the directory read-write (created `0600` when
    /// `create`), never through a link; refuses a file that is not ours.
    pub fn open_file(&self, name: &str, create: bool) -> Result<File> {
        let path = self.path.join(name);
        let flags = libc::O_RDWR | if create { libc::O_CREAT } else { 0 };
        let f = open_at(&self.dir, name, flags, 0o600).map_err(|e| open_error(&path, &e, false))?;
        check_owned(&f, &path, false)?;
        Ok(f)
    }

    /// Opens `name` again with extra `flags` (e.g. `O_DIRECT`); `None` if the file system
    /// refuses, or if what it opens is not the file `same` (replaced meanwhile).
    pub fn reopen(&self, name: &str, flags: libc::c_int, same: &File) -> Option<File> {
        let f = open_at(&self.dir, name, libc::O_RDWR | flags, 0).ok()?;
        let (a, b) = (f.metadata().ok()?, same.metadata().ok()?);
        (a.dev() == b.dev() && a.ino() == b.ino()).then_some(f)
    }

    /// The contents of `name` (`None` if it does not exist); a link is refused.
    pub fn read(&self, name: &str) -> Result<Option<Vec<u8>>> {
        read_at(&self.dir, &self.path.join(name), name)
    }

    /// Replaces `name` with `contents` atomically and durably: a temporary file (`0600`,
    /// created exclusively), fsynced, renamed over `name`, then the directory fsynced.
    pub fn replace(&self, name: &str, contents: &[u8]) -> Result<()> {
        let tmp = format!(".{name}.tmp");
        let tmp_path = self.path.join(&tmp);
        let ctmp = c_name(&tmp).map_err(|e| super::slab::io_err(&tmp_path, "bad name", &e))?;
        let cname = c_name(name).map_err(|e| super::slab::io_err(&tmp_path, "bad name", &e))?;
        let fd = self.dir.as_raw_fd();
        // A leftover of an interrupted replace (or anything an attacker put there) goes:
        // unlink never follows a link.
        #[allow(unsafe_code)]
        // SAFETY: `ctmp` is a NUL-terminated string alive for the call.
        unsafe {
            libc::unlinkat(fd, ctmp.as_ptr(), 0);
        }
        let f = open_at(
            &self.dir,
            &tmp,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
        )
        .map_err(|e| open_error(&tmp_path, &e, false))?;
        f.write_all_at(contents, 0)
            .and_then(|()| f.sync_all())
            .map_err(|e| super::slab::io_err(&tmp_path, "cannot write", &e))?;
        #[allow(unsafe_code)]
        // SAFETY: both names are NUL-terminated strings alive for the call.
        let r = unsafe { libc::renameat(fd, ctmp.as_ptr(), fd, cname.as_ptr()) };
        if r != 0 {
            return Err(super::slab::io_err(
                &self.path.join(name),
                "cannot replace",
                &io::Error::last_os_error(),
            ));
        }
        self.sync()
    }

    /// Makes the directory's entries durable (`fsync` of the directory).
    pub fn sync(&self) -> Result<()> {
        self.dir
            .sync_all()
            .map_err(|e| super::slab::io_err(&self.path, "cannot sync", &e))
    }
}

impl Drop for TierDir {
    fn drop(&mut self) {
        // The owner leaves: no pid names a holder any more (the kernel drops the lock).
        let _ = self.lock.set_len(0);
    }
}

fn read_at(dir: &File, path: &Path, name: &str) -> Result<Option<Vec<u8>>> {
    let mut f = match open_at(dir, name, libc::O_RDONLY, 0) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(open_error(path, &e, false)),
    };
    if !f
        .metadata()
        .map_err(|e| super::slab::io_err(path, "cannot stat", &e))?
        .is_file()
    {
        return Err(refused(path, "is not a regular file"));
    }
    let mut out = Vec::new();
    f.read_to_end(&mut out)
        .map_err(|e| super::slab::io_err(path, "cannot read", &e))?;
    Ok(Some(out))
}

/// A namespace directory opened read-only by a reader (the scheduler's scan, `inspect`):
/// nothing created, nothing followed.
#[derive(Debug)]
pub struct DirView {
    path: PathBuf,
    dir: File,
}

impl DirView {
    /// Opens `root/name` read-only; `Ok(None)` if it does not exist.
    pub fn open(root: &Path, name: &str) -> Result<Option<Self>> {
        Ok(open_subdir(root, name, false)?.map(|(path, dir)| Self { path, dir }))
    }

    /// Opens the directory at `path` (its last component not followed).
    pub fn at(path: &Path) -> Result<Option<Self>> {
        let name = path.file_name().map(|n| n.as_bytes().to_vec());
        let Some(Ok(name)) = name.map(String::from_utf8) else {
            return Err(refused(path, "is not a namespace directory name"));
        };
        let root = path.parent().unwrap_or_else(|| Path::new("."));
        Self::open(root, &name)
    }

    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the regular file `name` read-only; `Ok(None)` if it does not exist; a link or a
    /// file that is not a regular one is refused.
    pub fn open_file(&self, name: &str) -> Result<Option<File>> {
        let path = self.path.join(name);
        match open_at(&self.dir, name, libc::O_RDONLY, 0) {
            Ok(f) => {
                let md = f
                    .metadata()
                    .map_err(|e| super::slab::io_err(&path, "cannot stat", &e))?;
                if !md.is_file() {
                    return Err(refused(&path, "is not a regular file"));
                }
                Ok(Some(f))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(open_error(&path, &e, false)),
        }
    }

    /// The contents of `name` (`None` if it does not exist); a link is refused.
    pub fn read(&self, name: &str) -> Result<Option<Vec<u8>>> {
        read_at(&self.dir, &self.path.join(name), name)
    }

    /// Takes a shared lock on the directory's lock file for as long as the returned file
    /// lives: `Ok(Err(holder))` while an owner holds it. A directory without a lock file
    /// (never opened by an owner) is free.
    pub fn reader_lock(&self) -> Result<std::result::Result<Option<File>, String>> {
        let path = self.path.join(LOCK_FILE);
        let Some(f) = self.open_file(LOCK_FILE)? else {
            return Ok(Ok(None));
        };
        if try_flock(&f, libc::LOCK_SH)
            .map_err(|e| super::slab::io_err(&path, "cannot lock", &e))?
        {
            Ok(Ok(Some(f)))
        } else {
            Ok(Err(holder(&f)))
        }
    }
}
