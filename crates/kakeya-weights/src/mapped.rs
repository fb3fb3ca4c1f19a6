//! Checkpoint files mapped into memory instead of read (GGUF, safetensors): the OS pages
//! tensor data in as it is converted, and a model's file never sits in RAM twice. Also the
//! host-memory check made before converting a checkpoint to f32.

use std::ops::Deref;
use std::path::Path;

use crate::error::{Result, WeightsError};

/// A file's bytes: memory-mapped, or owned (images built in memory, empty files).
pub enum Mapped {
    /// Bytes held in memory.
    Owned(Vec<u8>),
    /// A read-only mapping of a file.
    Map(memmap2::Mmap),
}

impl std::fmt::Debug for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Mapped::Owned(_) => "owned",
            Mapped::Map(_) => "mapped",
        };
        write!(f, "Mapped({kind}, {} bytes)", self.len())
    }
}

impl Mapped {
    /// Maps `path` read-only.
    #[allow(unsafe_code)] // the one mapping: see SAFETY below
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| WeightsError::io(path, e))?;
        let len = file
            .metadata()
            .map_err(|e| WeightsError::io(path, e))?
            .len();
        if len == 0 {
            // Some platforms refuse to map nothing.
            return Ok(Mapped::Owned(Vec::new()));
        }
        // SAFETY: the mapping is read-only and private to this process. As with every
        // memory-mapped model loader (llama.cpp, safetensors), a file truncated or rewritten
        // by another process while mapped is outside what can be guarded against; Kakeya
        // writes checkpoints under temporary names and renames them, never in place.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| WeightsError::io(path, e))?;
        Ok(Mapped::Map(map))
    }
}

impl Deref for Mapped {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Mapped::Owned(v) => v,
            Mapped::Map(m) => m,
        }
    }
}

/// Host memory available for new allocations now (Linux: `MemAvailable` of
/// `/proc/meminfo`); `None` where it cannot be read.
pub fn available_host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses to load `source` when converting it needs `need` bytes and only `available` are
/// free (`None`: unknown, not checked) — a clear error before the allocations instead of the
/// OOM killer halfway through.
pub fn check_fits(source: &Path, need: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(free) if need > free => Err(WeightsError::format(
            source,
            format!(
                "the model does not fit in host memory: its weights need {:.2} GiB as Kakeya \
                 holds them (f32, plus the quantised blocks of a GGUF) but {:.2} GiB are \
                 available",
                gib(need),
                gib(free)
            ),
        )),
        _ => Ok(()),
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_larger_than_free_memory_is_refused_with_both_sizes() {
        let p = Path::new("big.gguf");
        assert!(check_fits(p, 10, Some(10)).is_ok());
        assert!(
            check_fits(p, u64::MAX, None).is_ok(),
            "unknown: not checked"
        );
        let e = check_fits(p, 3 << 30, Some(1 << 30))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("big.gguf: the model does not fit"), "{e}");
        assert!(
            e.contains("need 3.00 GiB") && e.contains("1.00 GiB are available"),
            "{e}"
        );
    }

    #[test]
    fn files_are_mapped_and_empty_ones_read() {
        let dir = std::env::temp_dir().join(format!("kakeya-mapped-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (full, empty) = (dir.join("f"), dir.join("e"));
        std::fs::write(&full, b"GGUF1234").unwrap();
        std::fs::write(&empty, b"").unwrap();
        let m = Mapped::open(&full).unwrap();
        assert!(matches!(m, Mapped::Map(_)));
        assert_eq!(&m[..], b"GGUF1234");
        assert_eq!(Mapped::open(&empty).unwrap().len(), 0);
        let e = Mapped::open(&dir.join("missing")).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
