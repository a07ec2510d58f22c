//! GPU telemetry through NVML. Where there is no NVML (no NVIDIA driver, a CPU
//! machine) it is absent, cleanly: no error, no GPU entries in the step records.

use gradflow_protocol::{Float, GpuStat};
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;

pub struct Telemetry {
    nvml: Option<Nvml>,
}

impl Telemetry {
    /// Loads NVML if the machine has it.
    pub fn new() -> Telemetry {
        let nvml = match Nvml::init() {
            Ok(nvml) => Some(nvml),
            Err(error) => {
                tracing::debug!(%error, "no NVML: GPU telemetry is off");
                None
            }
        };
        Telemetry { nvml }
    }

    /// One reading per device; a field NVML cannot read is left out.
    pub fn sample(&self) -> Vec<GpuStat> {
        let Some(nvml) = &self.nvml else {
            return Vec::new();
        };
        let count = nvml.device_count().unwrap_or(0);
        (0..count)
            .filter_map(|index| {
                let device = nvml.device_by_index(index).ok()?;
                let memory = device.memory_info().ok();
                Some(GpuStat {
                    index,
                    memory_used_bytes: memory.as_ref().map(|m| m.used),
                    memory_total_bytes: memory.as_ref().map(|m| m.total),
                    utilization_pct: device.utilization_rates().ok().map(|u| Float(u.gpu as f64)),
                    temperature_c: device
                        .temperature(TemperatureSensor::Gpu)
                        .ok()
                        .map(|t| Float(t as f64)),
                    power_w: device
                        .power_usage()
                        .ok()
                        .map(|mw| Float(mw as f64 / 1000.0)),
                })
            })
            .collect()
    }
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry::new()
    }
}
