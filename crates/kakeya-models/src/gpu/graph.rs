//! A GPU step recorded once and replayed ([`DeviceGraph`]): on CUDA a graph whose one launch
//! re-runs every kernel the step issued (CubeCL records wgpu's command buffers the same way),
//! against the buffers the step used when it was recorded. Burn's own `capture` keeps the
//! step's closure inside the graph, so the closure would have to own everything it touches;
//! a decode step borrows the session's caches, which the host updates between replays. This
//! drives the same backend calls without keeping the closure.

use burn::backend::{Backend, BackendGraph, Dispatch};
use burn::tensor::Device;

/// Runs of the step before the recorded one: Burn's memory pools then hold every buffer the
/// step allocates, so the recorded run allocates nothing new (as Burn's `capture` does).
const WARMUPS: usize = 3;

/// A recorded step: replaying it re-runs the recorded launches on the same buffers.
#[derive(Debug)]
pub struct DeviceGraph {
    device: Device,
    graph: BackendGraph<Dispatch>,
}

impl DeviceGraph {
    /// Runs `step` three times (`WARMUPS`), then once more while the device records it.
    /// Returns the recording (`None` where the device records nothing, or the recording
    /// failed: the caller then issues its steps one by one) and the last run's output. Under
    /// a recording a run's launches may only be recorded, not executed: replay once before
    /// reading what the step writes. An error of a run ends the recording and is returned.
    ///
    /// `step` must do the same work on the same buffers at every run: what it reads from the
    /// host is baked into the recording.
    pub fn record<T, E>(
        device: &Device,
        mut step: impl FnMut() -> Result<T, E>,
    ) -> Result<(Option<Self>, T), E> {
        let d = device.as_dispatch();
        // Where the device cannot prepare, it cannot record either: the start below says so.
        let _ = Dispatch::graph_prepare(d);
        for _ in 0..WARMUPS {
            let out = match step() {
                Ok(out) => out,
                Err(e) => {
                    // A prepared device waits for its recording: closing it frees the stream.
                    let _ = Dispatch::graph_stop_capture(d);
                    return Err(e);
                }
            };
            // Hold the output until the work ran (a lazy backend would skip it otherwise).
            let _ = Dispatch::sync(d);
            drop(out);
        }
        if Dispatch::graph_start_capture(d).is_err() {
            return Ok((None, step()?));
        }
        let out = step();
        // Stopping ends the recording whatever happened inside it.
        let graph = Dispatch::graph_stop_capture(d).ok();
        let out = out?;
        Ok((
            graph.map(|graph| Self {
                device: device.clone(),
                graph,
            }),
            out,
        ))
    }

    /// Re-runs the recorded launches (one dispatch on CUDA).
    ///
    /// # Safety
    ///
    /// Every buffer the recorded step read or wrote must still be alive and hold what the
    /// replay should read (inputs rewritten in place, on this device's stream), and nothing
    /// else may use those buffers while the replay runs: a replay reads and writes the raw
    /// buffers of the recording, with nothing tracking them.
    #[allow(unsafe_code)] // the replay: its contract is the caller's (above)
    pub unsafe fn replay(&self) -> Result<(), String> {
        // SAFETY: forwarded from this function's contract.
        unsafe { Dispatch::graph_replay(self.device.as_dispatch(), &self.graph) }
            .map_err(|e| format!("{e:?}"))
    }
}

/// The allocation `x`'s elements live in, on a CubeCL device without Burn's fusion: an id
/// CubeCL never gives a later allocation, and the byte offset into it. A recording holds raw
/// buffers; a step may replay it only while its buffers are the recorded ones. `None`
/// elsewhere.
pub fn buffer_of<const D: usize>(x: &burn::tensor::Tensor<D>) -> Option<(usize, u64)> {
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    {
        use burn::backend::{BackendTensor, DispatchTensorKind};
        if let DispatchTensorKind::Cube(BackendTensor::Float(t)) = x.clone().into_dispatch().kind {
            let h = &t.handle;
            return Some((h.memory.descriptor().id.value, h.offset_start.unwrap_or(0)));
        }
        None
    }
    #[cfg(not(all(feature = "cube", not(feature = "fusion"))))]
    {
        let _ = x;
        None
    }
}
