//! A GGUF (v2/v3) reader: header, metadata, tensor infos, alignment, dequantised tensors.
//!
//! Format: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>. Every length and offset
//! read from the file is bounds-checked, so a truncated or corrupt file gives an error naming the
//! file and the problem, never a panic or a huge allocation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Result, WeightsError};
use crate::mapped::Mapped;
use kakeya_kernels::dequant::{GgmlType, dequantize};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Unsigned integer of any width (u8, u16, u32, u64).
    UInt(u64),
    /// Signed integer of any width (i8, i16, i32, i64).
    Int(i64),
    /// Float (f32 or f64).
    Float(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string (invalid bytes replaced).
    String(String),
    /// Array of values.
    Array(Vec<GgufValue>),
    /// An array longer than [`MAX_DECODED_ARRAY`] (a tokenizer's vocabulary, scores or
    /// merges: Kakeya reads the tokenizer from `tokenizer.json`), checked to lie inside the
    /// file and skipped, not decoded: decoded, each 1-byte element would take 32 bytes.
    Skipped {
        /// GGUF type id of the elements.
        elem_type: u32,
        /// Number of elements.
        len: usize,
    },
}

/// Longest tensor name accepted (ggml's own limit is 64 bytes).
const MAX_TENSOR_NAME: usize = 256;

/// Longest metadata array decoded into values: far above any per-layer table (Gemma: 62).
pub const MAX_DECODED_ARRAY: usize = 1 << 16;

/// Bytes one element of GGUF value type `ty` takes in the file (at least: a string is its
/// 8-byte length and then its bytes), or `None` for an unknown type or a nested array.
fn elem_size(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        _ => return None,
    })
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::UInt(v) => Some(v),
            Self::Int(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::UInt(v) => Some(v as f64),
            Self::Int(v) => Some(v as f64),
            Self::Float(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }
}

/// Where one tensor lies in the file.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    /// Tensor name (GGUF naming, e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGUF order (fastest-varying first; the reverse of PyTorch's).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements.
    pub fn elems(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }

    /// Shape in PyTorch order (slowest-varying first).
    pub fn torch_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An opened GGUF file, held in memory.
#[derive(Debug)]
pub struct GgufFile {
    /// The file's path (for messages).
    pub path: PathBuf,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata, by key.
    pub metadata: BTreeMap<String, GgufValue>,
    /// Tensor infos, in file order.
    pub tensors: Vec<GgufTensorInfo>,
    bytes: Mapped,
    data_start: usize,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: &str) -> WeightsError {
        WeightsError::format(
            self.path,
            format!(
                "truncated or corrupt GGUF: {what} at byte {} (file has {})",
                self.pos,
                self.buf.len()
            ),
        )
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err(what))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that must fit in the rest of the file at `min_size` bytes per item.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        let rest = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_size as u64) > rest {
            return Err(self.err(&format!("{what} {n} exceeds the file")));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(1, what)?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }

    /// Moves past `n` elements of type `ty` without decoding them.
    fn skip_array(&mut self, ty: u32, n: usize) -> Result<()> {
        if ty == 8 {
            for _ in 0..n {
                let len = self.count(1, "string length")?;
                self.take(len, "string")?;
            }
        } else {
            let size = elem_size(ty).expect("checked by the caller");
            self.take(n * size, "array")?;
        }
        Ok(())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::UInt(self.array::<1>("u8")?[0] as u64),
            1 => GgufValue::Int(self.array::<1>("i8")?[0] as i8 as i64),
            2 => GgufValue::UInt(u16::from_le_bytes(self.array("u16")?) as u64),
            3 => GgufValue::Int(i16::from_le_bytes(self.array("i16")?) as i64),
            4 => GgufValue::UInt(self.u32("u32")? as u64),
            5 => GgufValue::Int(i32::from_le_bytes(self.array("i32")?) as i64),
            6 => GgufValue::Float(f32::from_le_bytes(self.array("f32")?) as f64),
            7 => GgufValue::Bool(self.array::<1>("bool")?[0] != 0),
            8 => GgufValue::String(self.string("string length")?),
            9 if depth == 0 => {
                let ety = self.u32("array type")?;
                let size = elem_size(ety)
                    .ok_or_else(|| self.err(&format!("array of unsupported type {ety}")))?;
                let n = self.count(size, "array length")?;
                if n > MAX_DECODED_ARRAY {
                    self.skip_array(ety, n)?;
                    return Ok(GgufValue::Skipped {
                        elem_type: ety,
                        len: n,
                    });
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::UInt(self.u64("u64")?),
            11 => GgufValue::Int(i64::from_le_bytes(self.array("i64")?)),
            12 => GgufValue::Float(f64::from_le_bytes(self.array("f64")?)),
            _ => return Err(self.err(&format!("unknown metadata value type {ty}"))),
        })
    }
}

impl GgufFile {
    /// Maps `path` into memory and validates it: magic, version, metadata, tensor infos and
    /// that every tensor's bytes lie inside the file. Tensor data is read from the mapping
    /// when asked for (nothing is copied up front).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::parse_mapped(path, Mapped::open(path)?)
    }

    /// Parses an in-memory GGUF image; `path` is used in messages only.
    pub fn parse(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        Self::parse_mapped(path, Mapped::Owned(bytes))
    }

    fn parse_mapped(path: &Path, bytes: Mapped) -> Result<Self> {
        let mut c = Cursor {
            buf: &bytes,
            pos: 0,
            path,
        };
        let magic = c.array::<4>("magic")?;
        if &magic != MAGIC {
            return Err(WeightsError::format(
                path,
                format!("not a GGUF file: magic is {magic:02x?}, expected \"GGUF\""),
            ));
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(WeightsError::format(
                path,
                format!("unsupported GGUF version {version} (need 2 or 3)"),
            ));
        }
        let n_tensors = c.count(24, "tensor count")?;
        let n_kv = c.count(12, "metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata type")?;
            let value = c.value(ty, 0)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            if name.len() > MAX_TENSOR_NAME {
                return Err(WeightsError::format(
                    path,
                    format!(
                        "a tensor name of {} bytes (at most {MAX_TENSOR_NAME}): corrupt tensor infos",
                        name.len()
                    ),
                ));
            }
            let n_dims = c.u32("tensor rank")? as usize;
            if n_dims > 4 {
                return Err(WeightsError::format(
                    path,
                    format!("tensor `{name}` has rank {n_dims} (max 4)"),
                ));
            }
            let dims = (0..n_dims)
                .map(|_| c.u64("tensor dim"))
                .collect::<Result<Vec<_>>>()?;
            let type_id = c.u32("tensor type")?;
            let offset = c.u64("tensor offset")?;
            let ty = GgmlType::from_id(type_id).ok_or_else(|| WeightsError::UnsupportedType {
                path: path.to_path_buf(),
                tensor: name.clone(),
                type_id,
                type_name: GgmlType::name_of_id(type_id).to_string(),
            })?;
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v.as_u64().filter(|a| a.is_power_of_two()).ok_or_else(|| {
                WeightsError::format(
                    path,
                    format!("general.alignment {v:?} is not a power of two"),
                )
            })?,
        };
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let file = Self {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            data_start: data_start as usize,
            bytes,
        };
        for t in &file.tensors {
            file.byte_range(t)?;
        }
        Ok(file)
    }

    fn byte_range(&self, t: &GgufTensorInfo) -> Result<std::ops::Range<usize>> {
        let elems = t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let len = elems
            .and_then(|n| t.ty.bytes_for(n as usize))
            .ok_or_else(|| {
                WeightsError::format(
                    &self.path,
                    format!(
                        "tensor `{}` has invalid dims {:?} for {:?}",
                        t.name, t.dims, t.ty
                    ),
                )
            })?;
        let start = (self.data_start as u64).checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(len as u64));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.bytes.len() as u64 => Ok(s as usize..e as usize),
            _ => Err(WeightsError::format(
                &self.path,
                format!(
                    "truncated GGUF: tensor `{}` needs bytes up to {} but the file has {}",
                    t.name,
                    end.unwrap_or(u64::MAX),
                    self.bytes.len()
                ),
            )),
        }
    }

    /// Where the tensor data starts: the header (metadata, tensor infos, padding) is the
    /// bytes before it.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// The tensor info called `name`.
    pub fn info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (still quantised) bytes of a tensor.
    pub fn raw(&self, t: &GgufTensorInfo) -> Result<&[u8]> {
        Ok(&self.bytes[self.byte_range(t)?])
    }

    /// Dequantises tensor `name` to f32: (shape in PyTorch order, row-major values).
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let t = self.info(name).ok_or_else(|| WeightsError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
        })?;
        let raw = self.raw(t)?;
        Ok((t.torch_shape(), dequantize(t.ty, raw, t.elems())))
    }

    /// Metadata value `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// Required unsigned metadata value.
    pub fn req_u64(&self, key: &str) -> Result<u64> {
        self.get(key)
            .and_then(GgufValue::as_u64)
            .ok_or_else(|| WeightsError::MissingField {
                path: self.path.clone(),
                field: key.to_string(),
            })
    }

    /// Required float metadata value.
    pub fn req_f64(&self, key: &str) -> Result<f64> {
        self.get(key)
            .and_then(GgufValue::as_f64)
            .ok_or_else(|| WeightsError::MissingField {
                path: self.path.clone(),
                field: key.to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a minimal GGUF image with one metadata string and one F32 tensor.
    pub(crate) fn tiny_gguf(type_id: u32) -> Vec<u8> {
        image(&[], type_id)
    }

    /// `general.architecture = gemma3`, then the encoded key/value pairs `extra`, and one
    /// 4-element tensor `w` of type `type_id`.
    fn image(extra: &[Vec<u8>], type_id: u32) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&(1 + extra.len() as u64).to_le_bytes()); // kv
        let key = b"general.architecture";
        b.extend_from_slice(&(key.len() as u64).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&6u64.to_le_bytes());
        b.extend_from_slice(b"gemma3");
        for kv in extra {
            b.extend_from_slice(kv);
        }
        let name = b"w";
        b.extend_from_slice(&(name.len() as u64).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&type_id.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for v in [1.0f32, 2.0, 3.0, 4.0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// A metadata key holding an array of `n` elements of type `ty` (`elem`: each one's
    /// bytes), and the offset of its length field within the encoding.
    fn array_kv(ty: u32, n: u64, elem: &[u8]) -> (Vec<u8>, usize) {
        let mut kv = Vec::new();
        let key = b"tokenizer.ggml.tokens";
        kv.extend_from_slice(&(key.len() as u64).to_le_bytes());
        kv.extend_from_slice(key);
        kv.extend_from_slice(&9u32.to_le_bytes());
        kv.extend_from_slice(&ty.to_le_bytes());
        let len_at = kv.len();
        kv.extend_from_slice(&n.to_le_bytes());
        for _ in 0..n {
            kv.extend_from_slice(elem);
        }
        (kv, len_at)
    }

    fn with_array(ty: u32, n: usize, elem: &[u8]) -> Vec<u8> {
        image(&[array_kv(ty, n as u64, elem).0], 0)
    }

    #[test]
    fn long_metadata_arrays_are_skipped_not_decoded() {
        // Short: decoded. Long (u8s, or strings): checked and skipped; the keys after them
        // still read.
        let short = GgufFile::parse(Path::new("t.gguf"), with_array(0, 3, &[7])).unwrap();
        assert_eq!(
            short.get("tokenizer.ggml.tokens"),
            Some(&GgufValue::Array(vec![GgufValue::UInt(7); 3]))
        );
        let n = MAX_DECODED_ARRAY + 1;
        let mut string = 2u64.to_le_bytes().to_vec();
        string.extend_from_slice(b"ab");
        for (ty, elem) in [(0u32, vec![7u8]), (8, string)] {
            let f = GgufFile::parse(Path::new("t.gguf"), with_array(ty, n, &elem)).unwrap();
            assert_eq!(
                f.get("tokenizer.ggml.tokens"),
                Some(&GgufValue::Skipped {
                    elem_type: ty,
                    len: n
                })
            );
            assert_eq!(
                f.get("general.architecture").and_then(|v| v.as_str()),
                Some("gemma3")
            );
            assert_eq!(f.tensor_f32("w").unwrap().1, vec![1.0, 2.0, 3.0, 4.0]);
        }
        // An array longer than the bytes left is refused before anything is allocated.
        let (mut kv, len_at) = array_kv(4, 3, &[0; 4]);
        kv[len_at..len_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let e = GgufFile::parse(Path::new("t.gguf"), image(&[kv], 0))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("array length 1099511627776 exceeds the file"),
            "{e}"
        );
    }

    #[test]
    fn parses_a_minimal_file() {
        let f = GgufFile::parse(Path::new("t.gguf"), tiny_gguf(0)).unwrap();
        assert_eq!(
            f.get("general.architecture").and_then(|v| v.as_str()),
            Some("gemma3")
        );
        assert_eq!(
            f.tensor_f32("w").unwrap(),
            (vec![4], vec![1.0, 2.0, 3.0, 4.0])
        );
    }

    #[test]
    fn truncated_file_is_an_error_naming_the_tensor() {
        let mut b = tiny_gguf(0);
        b.truncate(b.len() - 3);
        let e = GgufFile::parse(Path::new("t.gguf"), b)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.gguf") && e.contains("truncated") && e.contains("`w`"),
            "{e}"
        );
        // Cut inside the header too.
        let e = GgufFile::parse(Path::new("t.gguf"), tiny_gguf(0)[..30].to_vec())
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated"), "{e}");
    }

    #[test]
    fn wrong_magic_is_an_error() {
        let mut b = tiny_gguf(0);
        b[0] = b'X';
        let e = GgufFile::parse(Path::new("t.gguf"), b)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a GGUF file"), "{e}");
    }

    #[test]
    fn unknown_quant_type_is_an_error() {
        let e = GgufFile::parse(Path::new("t.gguf"), tiny_gguf(16))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unsupported GGML type 16 (IQ2_XXS)") && e.contains("`w`"),
            "{e}"
        );
    }
}
