//! The f32 product of longer inputs (prefill, chunked attention) on a GPU, with f32 operands
//! all the way through.
//!
//! Burn's CUDA matmul takes cubek's tensor-core strategy, which stages f32 operands as TF32
//! (10-bit mantissas): the default model's prompt logits then drift ≈ 2e-2 from transformers'
//! f32 (`docs/benchmarks.md`). Here the same library's unit strategy runs instead — plain f32
//! FMAs, the one Burn itself falls back to on devices without tensor cores (wgpu on lavapipe).

use burn::tensor::DType;
use burn_cubecl::kernel::matmul::init_matmul_output;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::{ElemType, FloatKind};
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::launch_ref;
use cubek::matmul::multi_level::Strategy as Routine;
use cubek::matmul::strategy::Strategy;
use cubek::std::InputBinding;

use super::kernels::f32_only;

/// See [`super::DecodeKernels::matmul_f32`].
pub(super) fn matmul_f32(lhs: CubeTensor, rhs: CubeTensor) -> CubeTensor {
    f32_only(&lhs, "matmul_f32");
    f32_only(&rhs, "matmul_f32");
    let out = init_matmul_output(&lhs, &rhs, DType::F32);
    let elem = ElemType::Float(FloatKind::F32);
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: elem,
        rhs: elem,
        out: elem,
    });
    let strategy = Strategy::MultiLevel(Routine::SimpleUnit(Default::default()));
    let client = out.client.clone();
    launch_ref(
        &strategy,
        &client,
        InputBinding::new(lhs.binding(), elem),
        InputBinding::new(rhs.binding(), elem),
        out.clone().binding(),
        &mut dtypes,
    )
    .unwrap_or_else(|e| panic!("matmul_f32: cubek's unit matmul refused the shapes: {e:?}"));
    out
}
