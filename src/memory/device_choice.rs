//! Which device a run uses: `--device cpu|cuda|cuda:N`, `--cpu`, or train.json's `gpuid`
//! (EveryDream2's card index). A card that does not exist is an error naming the cards found;
//! with nothing asked for, the first card is used when there is one, else the CPU.

use std::str::FromStr;

use candle_core::Device;

/// What the command line and train.json ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRequest {
    /// `--device cpu` or `--cpu`.
    Cpu,
    /// `--device cuda:N` (`cuda` is `cuda:0`): that card, or an error.
    Cuda(usize),
    /// Nothing on the command line: card `gpuid` (train.json, 0 when unset) if this build and
    /// machine have CUDA cards; the CPU when they have none and `gpuid` is 0.
    Auto { gpuid: usize },
}

/// A `--device` value that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("--device {0:?}: expected `cpu`, `cuda` or `cuda:N` (a card index, e.g. `cuda:1`)")]
pub struct BadDeviceName(pub String);

impl FromStr for DeviceRequest {
    type Err = BadDeviceName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadDeviceName(s.to_string());
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda(0)),
            other => {
                let index = other
                    .strip_prefix("cuda:")
                    .or_else(|| other.strip_prefix("gpu:"))
                    .ok_or_else(bad)?;
                index.parse().map(Self::Cuda).map_err(|_| bad())
            }
        }
    }
}

/// The card asked for is not there.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{asked} asks for CUDA card {index}, but {}", found_text(.cards, .cuda_built))]
    NoSuchCard {
        /// Where the request came from: `--device cuda:1` or `gpuid 1 in train.json`.
        asked: String,
        index: usize,
        cards: Vec<String>,
        cuda_built: bool,
    },
    #[error("cannot open CUDA card {index} ({asked})")]
    Open {
        asked: String,
        index: usize,
        #[source]
        source: candle_core::Error,
    },
}

fn found_text(cards: &[String], cuda_built: &bool) -> String {
    if !cuda_built {
        return "this sdtrain was built without CUDA (build with `--features cuda`)".to_string();
    }
    match cards.len() {
        0 => "no CUDA card was found".to_string(),
        1 => format!("this machine has 1 CUDA card: {}", cards[0]),
        n => format!("this machine has {n} CUDA cards: {}", cards.join("; ")),
    }
}

/// The CUDA cards this build and machine have, as `N: name (X GiB)`.
pub fn cuda_cards() -> Vec<String> {
    cards_impl::list()
}

/// Opens the device `request` names; `asked` says where a card index came from, for errors.
pub fn open_device(request: DeviceRequest) -> Result<Device, DeviceError> {
    let (index, asked, required) = match request {
        DeviceRequest::Cpu => return Ok(Device::Cpu),
        DeviceRequest::Cuda(n) => (n, format!("--device cuda:{n}"), true),
        DeviceRequest::Auto { gpuid } => (gpuid, format!("gpuid {gpuid} in train.json"), gpuid > 0),
    };
    let cards = cuda_cards();
    if index >= cards.len() {
        if !required {
            return Ok(Device::Cpu);
        }
        return Err(DeviceError::NoSuchCard {
            asked,
            index,
            cards,
            cuda_built: cfg!(feature = "cuda"),
        });
    }
    Device::new_cuda(index).map_err(|source| DeviceError::Open {
        asked,
        index,
        source,
    })
}

#[cfg(feature = "cuda")]
mod cards_impl {
    use candle_core::cuda_backend::cudarc::driver::result;

    pub(super) fn list() -> Vec<String> {
        if result::init().is_err() {
            return Vec::new();
        }
        let count = result::device::get_count().unwrap_or(0).max(0);
        (0..count)
            .map(|i| {
                let Ok(dev) = result::device::get(i) else {
                    return format!("{i}: (unreadable)");
                };
                let name = result::device::get_name(dev).unwrap_or_else(|_| "?".to_string());
                // Safety: `dev` is a device handle the driver just returned.
                match unsafe { result::device::total_mem(dev) } {
                    Ok(bytes) => format!("{i}: {name} ({:.0} GiB)", bytes as f64 / 1073741824.0),
                    Err(_) => format!("{i}: {name}"),
                }
            })
            .collect()
    }
}

#[cfg(not(feature = "cuda"))]
mod cards_impl {
    pub(super) fn list() -> Vec<String> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        let p = |s: &str| s.parse::<DeviceRequest>();
        assert_eq!(p("cpu").unwrap(), DeviceRequest::Cpu);
        assert_eq!(p("cuda").unwrap(), DeviceRequest::Cuda(0));
        assert_eq!(p("cuda:3").unwrap(), DeviceRequest::Cuda(3));
        assert_eq!(p("CUDA:1").unwrap(), DeviceRequest::Cuda(1));
        for bad in ["cuda:", "cuda:-1", "cuda:x", "tpu", ""] {
            let err = p(bad).unwrap_err();
            assert!(err.to_string().contains("cuda:N"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_missing_card_names_what_was_found() {
        let cards = cuda_cards();
        let err = open_device(DeviceRequest::Cuda(cards.len() + 7)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("--device cuda:{}", cards.len() + 7)),
            "{msg}"
        );
        if cfg!(feature = "cuda") {
            assert!(msg.contains("CUDA card"), "{msg}");
        } else {
            assert!(msg.contains("built without CUDA"), "{msg}");
        }
        let err = open_device(DeviceRequest::Auto { gpuid: 9 }).unwrap_err();
        assert!(err.to_string().contains("gpuid 9 in train.json"), "{err}");
    }

    #[test]
    fn no_request_falls_back_to_the_cpu_without_cards() {
        if cuda_cards().is_empty() {
            let d = open_device(DeviceRequest::Auto { gpuid: 0 }).unwrap();
            assert!(d.is_cpu());
        }
        assert!(open_device(DeviceRequest::Cpu).unwrap().is_cpu());
    }
}
