//! KAKEYA PATCH: stands in for `cubecl-llvm`, whose build script downloads a prebuilt LLVM
//! (`tracel-llvm-bundler`) that an offline machine cannot fetch. Only the NVRTC (CUDA C++)
//! backend remains: `CudaBackend::default()` is `Cpp`, and asking for the LLVM backend is a
//! compilation error at run time. `PtxVersion` is cubecl-llvm's own file (MIT OR Apache-2.0).

use cubecl_core::ir::DeviceProperties;
use cubecl_core::ir::nvidia::SmArch;
use cubecl_core::prelude::KernelDefinition;
use cubecl_server::compiler::CompilationError;
use cubecl_server::kernel::BufferIOAttr;

pub mod nvptx {
    pub mod ptx_version {
        pub use crate::ptx_version::PtxVersion;
    }
}

pub mod shared {
    pub mod lowered_features {
        /// The only target this crate knows.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            Nvptx,
        }

        /// Nothing to narrow: the LLVM backend is not built.
        pub fn restrict_features(_props: &mut super::super::DeviceProperties, _t: GpuTarget) {}
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlvmTarget {
    Nvptx,
}

#[derive(Clone, Debug)]
pub struct PlironCompiler {
    pub target: LlvmTarget,
}

#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    pub arch: Option<()>,
    pub sm_arch: Option<SmArch>,
    pub ptx_version: Option<crate::ptx_version::PtxVersion>,
    pub grid_constants: bool,
}

#[derive(Debug)]
pub struct NvptxModule {
    pub ptx: Vec<core::ffi::c_char>,
    pub entrypoint: String,
    pub ir: String,
    pub shared_memory_size: usize,
    pub io: Vec<BufferIOAttr>,
}

pub enum PlironArtifact {
    NvptxCode(NvptxModule),
    #[allow(dead_code)]
    Unsupported,
}

impl PlironCompiler {
    pub fn lang_tag(&self) -> &'static str {
        "llvm"
    }

    pub fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &PlironOptions,
    ) -> Result<PlironArtifact, CompilationError> {
        Err(CompilationError::Generic {
            reason: "this cubecl-cuda was built without the LLVM backend (Kakeya's offline \
                     patch); use the CUDA C++ (NVRTC) backend"
                .to_string(),
            backtrace: cubecl_environment::backtrace::BackTrace::capture(),
        })
    }
}
