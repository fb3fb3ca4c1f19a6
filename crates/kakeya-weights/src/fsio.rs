//! Atomic file writes, the one implementation every crate uses: the content goes to a hidden
//! temporary sibling (`.{name}.tmp-{pid}`), is flushed to disk, and is renamed over the target,
//! so a reader (or a resumed job) sees the old file or the whole new one, never a torn one. On
//! failure the temporary file is removed. Folders: [`crate::checkpoint::write_dir_atomically`].

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The temporary sibling a write of `path` goes through.
pub fn temp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Writes `path` atomically with `fill`, which writes the content into the open temporary
/// file and returns a value or an error of its own type (`io` converts I/O errors of the
/// create, flush and rename steps, naming the file they concern).
pub fn write_file_with<T, E>(
    path: &Path,
    fill: impl FnOnce(&mut File) -> Result<T, E>,
    io: impl Fn(&Path, io::Error) -> E,
) -> Result<T, E> {
    let tmp = temp_sibling(path);
    let result = (|| {
        let mut f = File::create(&tmp).map_err(|e| io(&tmp, e))?;
        let out = fill(&mut f)?;
        f.flush()
            .and_then(|()| f.sync_all())
            .map_err(|e| io(&tmp, e))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| io(path, e))?;
        Ok(out)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes `bytes` to `path` atomically.
pub fn write_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_file_with(path, |f| f.write_all(bytes), |_, e| e)
}

/// Copies `from` to `to` atomically.
pub fn copy_file(from: &Path, to: &Path) -> io::Result<()> {
    write_file_with(
        to,
        |f| {
            let mut src = File::open(from)?;
            io::copy(&mut src, f).map(|_| ())
        },
        |_, e| e,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_whole_files_and_leaves_nothing_behind_on_failure() {
        let dir = std::env::temp_dir().join(format!("kakeya-fsio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.json");
        write_file(&p, b"one").unwrap();
        write_file(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let q = dir.join("b.bin");
        copy_file(&p, &q).unwrap();
        assert_eq!(std::fs::read(&q).unwrap(), b"two");
        // A failing fill keeps the old content and removes its temporary file.
        let err = write_file_with(
            &p,
            |f| {
                f.write_all(b"torn")?;
                Err::<(), _>(io::Error::other("fill failed"))
            },
            |_, e| e,
        );
        assert!(err.is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(left.iter().all(|n| !n.contains(".tmp-")), "{left:?}");
        // A missing source is an error, and no target appears.
        assert!(copy_file(&dir.join("nope"), &dir.join("c")).is_err());
        assert!(!dir.join("c").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
