//! The disk tier's directory against an adversary: one owner per namespace directory (a second
//! opener in this process or in another one is refused, naming the directory and the holder),
//! no symbolic link followed (in place of the directory, the slab file, the layout note, the
//! lock file or the note's temporary file), owner-only files, a layout note replaced
//! atomically and left alone when unchanged, a clean close that syncs, and headers that carry
//! the writer's whole tensor layout.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kvoffload::error::Error;
use kvoffload::policy::PolicyKind;
use kvoffload::tier::disk::{
    engine_namespace, layout_namespace, scan_namespace, DiskOptions, DiskTier, SlabFile,
    SlabLayout, BLOCK, LAYOUT_FILE, LOCK_FILE, SLAB_FILE,
};
use kvoffload::tier::namespace::Namespace;
use kvoffload::Key;

mod support;
use support::serial;

const LEN: usize = 8192;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvo-owner-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn ns() -> Namespace {
    engine_namespace("m", LEN as u64, 16, 1, 0, 1, 0)
}

fn opts(root: &Path, slots: u64) -> DiskOptions {
    DiskOptions {
        root: root.to_path_buf(),
        disk_bytes: slots * (BLOCK + (LEN as u64).div_ceil(BLOCK) * BLOCK),
        chunk_bytes: LEN as u64,
        policy: PolicyKind::Lru,
        direct: false,
        sync: true,
    }
}

fn dir(root: &Path) -> PathBuf {
    root.join(ns().dir_name())
}

fn put(t: &mut DiskTier, key: u128) {
    let data = vec![key as u8; LEN];
    assert_eq!(t.put(&[(Key(key), vec![&data[..]])]), Some(vec![Key(key)]));
}

#[test]
fn a_second_opener_in_this_process_is_refused_naming_the_directory_and_holder() {
    let _serial = serial();
    let root = tmp("twice");
    let mut first = DiskTier::open(&opts(&root, 4), &ns()).unwrap();
    put(&mut first, 1);
    let err = DiskTier::open(&opts(&root, 4), &ns()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::TierInUse { .. }), "{err:?}");
    assert!(msg.contains(&ns().dir_name()), "{msg}");
    assert!(
        msg.contains(&format!("pid {}", std::process::id())),
        "{msg}"
    );
    // The refused opener changed nothing: the owner's chunk is still served.
    let mut buf = vec![0u8; LEN];
    assert!(first.get(Key(1), &mut [&mut buf[..]]));
    drop(first);
    let t = DiskTier::open(&opts(&root, 4), &ns()).unwrap();
    assert_eq!(t.index().recovered(), 1);
    drop(t);
    let _ = std::fs::remove_dir_all(&root);
}

const HOLD_DIR: &str = "KVOFFLOAD_HOLD_DIR";

/// The holder of `a_second_process_is_refused` (runs only as its child process): opens the
/// tier, says READY and keeps it until its stdin closes.
#[test]
#[ignore = "child process of a_second_process_is_refused"]
fn hold_child() {
    let _serial = serial();
    let Some(d) = std::env::var_os(HOLD_DIR) else {
        return;
    };
    let t = DiskTier::open(&opts(Path::new(&d), 4), &ns()).unwrap();
    println!("READY");
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(t);
}

#[test]
fn a_second_process_is_refused() {
    let _serial = serial();
    let root = tmp("process");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "hold_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HOLD_DIR, &root)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.by_ref().any(|l| l.unwrap().ends_with("READY")));
    let err = DiskTier::open(&opts(&root, 4), &ns()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::TierInUse { .. }), "{err:?}");
    assert!(msg.contains(&format!("process {}", child.id())), "{msg}");
    // The scheduler's read-only scan still works while a worker owns the directory.
    let layout = SlabLayout::new(LEN as u64, opts(&root, 4).disk_bytes).unwrap();
    assert_eq!(scan_namespace(&root, &ns(), layout).unwrap().free, 4);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    // Gone with its owner.
    DiskTier::open(&opts(&root, 4), &ns()).unwrap();
    let _ = std::fs::remove_dir_all(&root);
}

/// Creates the tier's directory and files once, then closes it.
fn made(name: &str) -> PathBuf {
    let root = tmp(name);
    let mut t = DiskTier::open(&opts(&root, 4), &ns()).unwrap();
    put(&mut t, 7);
    drop(t);
    root
}

#[test]
fn a_symbolic_link_in_the_tier_is_refused_and_its_target_untouched() {
    let _serial = serial();
    for name in [SLAB_FILE, LAYOUT_FILE, LOCK_FILE] {
        let root = made(&format!("link-{name}"));
        let target = root.join("precious");
        std::fs::write(&target, b"precious").unwrap();
        let path = dir(&root).join(name);
        std::fs::remove_file(&path).unwrap();
        symlink(&target, &path).unwrap();
        let err = DiskTier::open(&opts(&root, 4), &ns()).unwrap_err();
        assert!(matches!(err, Error::TierPath { .. }), "{name}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains("symbolic link"), "{msg}");
        assert_eq!(std::fs::read(&target).unwrap(), b"precious", "{name}");
        let _ = std::fs::remove_dir_all(&root);
    }
    // The namespace directory itself.
    let root = made("link-dir");
    let elsewhere = root.join("elsewhere");
    std::fs::rename(dir(&root), &elsewhere).unwrap();
    symlink(&elsewhere, dir(&root)).unwrap();
    let before = std::fs::read(elsewhere.join(SLAB_FILE)).unwrap();
    let err = DiskTier::open(&opts(&root, 8), &ns()).unwrap_err();
    assert!(matches!(err, Error::TierPath { .. }), "{err:?}");
    assert_eq!(std::fs::read(elsewhere.join(SLAB_FILE)).unwrap(), before);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_hard_linked_slab_is_refused() {
    let _serial = serial();
    let root = made("hardlink");
    let other = root.join("other-name");
    std::fs::hard_link(dir(&root).join(SLAB_FILE), &other).unwrap();
    let before = std::fs::read(&other).unwrap();
    let err = DiskTier::open(&opts(&root, 8), &ns()).unwrap_err();
    assert!(err.to_string().contains("hard links"), "{err}");
    assert_eq!(std::fs::read(&other).unwrap(), before);
    let _ = std::fs::remove_dir_all(&root);
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o777
}

#[test]
fn files_and_directories_are_owner_only() {
    let _serial = serial();
    let root = made("modes");
    let d = dir(&root);
    assert_eq!(mode(&d), 0o700);
    for name in [SLAB_FILE, LAYOUT_FILE, LOCK_FILE] {
        assert_eq!(mode(&d.join(name)), 0o600, "{name}");
    }
    // Ours with wider permissions (an older build's) are narrowed at open.
    std::fs::set_permissions(d.join(SLAB_FILE), std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    drop(DiskTier::open(&opts(&root, 4), &ns()).unwrap());
    assert_eq!((mode(&d), mode(&d.join(SLAB_FILE))), (0o700, 0o600));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn the_layout_note_is_left_alone_when_unchanged_and_replaced_atomically() {
    let _serial = serial();
    let root = made("note");
    let note = dir(&root).join(LAYOUT_FILE);
    // An old timestamp: a rewrite would change it.
    let f = std::fs::File::options().write(true).open(&note).unwrap();
    let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    f.set_modified(old).unwrap();
    drop(f);
    let ino = std::fs::metadata(&note).unwrap().ino();
    drop(DiskTier::open(&opts(&root, 4), &ns()).unwrap());
    assert_eq!(std::fs::metadata(&note).unwrap().modified().unwrap(), old);
    // Another geometry: a new note, by rename (a new inode), even with a link planted where its
    // temporary file goes; the link's target is untouched.
    let target = root.join("precious");
    std::fs::write(&target, b"precious").unwrap();
    symlink(&target, dir(&root).join(format!(".{LAYOUT_FILE}.tmp"))).unwrap();
    let t = DiskTier::open(&opts(&root, 6), &ns()).unwrap();
    assert_eq!(t.index().recovered(), 1);
    drop(t);
    assert_ne!(std::fs::metadata(&note).unwrap().ino(), ino);
    assert!(std::fs::read_to_string(&note).unwrap().contains("slots=6"));
    assert_eq!(std::fs::read(&target).unwrap(), b"precious");
    assert!(!dir(&root).join(format!(".{LAYOUT_FILE}.tmp")).exists());
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_clean_close_syncs_what_it_acknowledged() {
    let _serial = serial();
    // Without per-batch barriers, nothing is synced until the close; with them, the last
    // batch's headers still are only in the page cache until the close.
    for (sync, before) in [(false, 0), (true, 1)] {
        let root = tmp(&format!("close-{sync}"));
        let mut o = opts(&root, 4);
        o.sync = sync;
        let mut t = DiskTier::open(&o, &ns()).unwrap();
        put(&mut t, 3);
        assert_eq!(t.file().io_stats().syncs, before);
        let s = t.close().unwrap();
        assert_eq!(s.syncs, before + 1);
        let t = DiskTier::open(&o, &ns()).unwrap();
        assert_eq!(t.index().recovered(), 1);
        drop(t);
        let _ = std::fs::remove_dir_all(&root);
    }
}

#[test]
fn headers_carry_the_tensor_layout_and_another_layout_reads_nothing() {
    let _serial = serial();
    let root = tmp("layout");
    let layout = SlabLayout::new(LEN as u64, opts(&root, 4).disk_bytes).unwrap();
    let place = ns();
    let one = layout_namespace(&place, "", &[LEN as u64]);
    let two = layout_namespace(&place, "", &[LEN as u64 / 2, LEN as u64 / 2]);
    assert_ne!(
        layout_namespace(&place, "float16", &[LEN as u64]).digest(),
        one.digest()
    );
    assert_ne!(one.digest(), two.digest());
    // A one-tensor engine writes a chunk.
    let f = SlabFile::open_in(&root, &place.dir_name(), &one, layout, false, true).unwrap();
    let data = vec![5u8; LEN];
    let item = kvoffload::tier::disk::WriteItem {
        slot: 0,
        key: Key(9),
        generation: 1,
        pieces: vec![&data[..]],
    };
    assert!(f.write(&[item]).iter().all(Result::is_ok));
    drop(f);
    // The scheduler finds it through the note (it knows only the chunk's place).
    assert_eq!(
        scan_namespace(&root, &place, layout).unwrap().chunks.len(),
        1
    );
    // A two-tensor engine of the same chunk size opens the same place and reads nothing.
    let f = SlabFile::open_in(&root, &place.dir_name(), &two, layout, false, true).unwrap();
    let scan = f.scan().unwrap();
    assert_eq!((scan.chunks.len(), scan.foreign), (0, 1));
    let mut buf = vec![0u8; LEN];
    let loc = kvoffload::tier::Location {
        place: 0,
        generation: 1,
    };
    // Refused (its bytes, read into the buffer, are not served).
    let err = f.read(Key(9), loc, &mut [&mut buf[..]]).unwrap_err();
    assert!(err.to_string().contains("namespace"), "{err}");
    drop(f);
    assert_eq!(
        scan_namespace(&root, &place, layout).unwrap().chunks.len(),
        0
    );
    let _ = std::fs::remove_dir_all(&root);
}
