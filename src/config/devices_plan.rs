//! `devices` (train.json) and `--devices` (the command line): the devices of a data-parallel run,
//! one rank per entry. Card indices (`0`), `cuda:N` or `cpu`, as a list or one comma-separated
//! string (`"0,1,2,3"`). A card may be listed once; `cpu` any number of times (ranks on the CPU,
//! for tests and for trying a config on a machine without cards).

use serde::{Deserialize, Serialize};

use super::ctx::Ctx;
use super::ConfigError;
use crate::memory::DeviceRequest;

/// `devices` as train.json may give it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum DevicesValue {
    List(Vec<DeviceName>),
    Text(String),
}

/// One entry: a card index or a device name.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum DeviceName {
    Index(i64),
    Name(String),
}

/// The canonical name of `d`: `cpu` or `cuda:N`.
pub fn device_name(d: DeviceRequest) -> String {
    match d {
        DeviceRequest::Cpu => "cpu".into(),
        DeviceRequest::Cuda(i) | DeviceRequest::Auto { gpuid: i } => format!("cuda:{i}"),
    }
}

fn one(entry: &str) -> Result<DeviceRequest, String> {
    let e = entry.trim();
    if let Ok(i) = e.parse::<usize>() {
        return Ok(DeviceRequest::Cuda(i));
    }
    e.parse::<DeviceRequest>().map_err(|_| {
        format!("{entry:?} is not a device: give card indices (`0`), `cuda:N` or `cpu`")
    })
}

/// The devices of a comma-separated list (`0,1` or `cpu,cpu`), checked: not empty, no card
/// twice.
pub fn parse_device_list(text: &str) -> Result<Vec<DeviceRequest>, String> {
    let entries: Vec<&str> = text.split(',').filter(|e| !e.trim().is_empty()).collect();
    checked(entries.into_iter().map(one).collect::<Result<_, _>>()?)
}

fn checked(list: Vec<DeviceRequest>) -> Result<Vec<DeviceRequest>, String> {
    if list.is_empty() {
        return Err("lists no device".into());
    }
    for (i, d) in list.iter().enumerate() {
        if let DeviceRequest::Cuda(card) = d {
            if list[..i].contains(d) {
                return Err(format!("lists card {card} twice: one rank per card"));
            }
        }
    }
    Ok(list)
}

/// train.json's `devices`, as canonical names (empty when unset).
pub(super) fn resolve_devices(
    v: Option<&DevicesValue>,
    ctx: &Ctx<'_>,
) -> Result<Vec<String>, ConfigError> {
    let list = match v {
        None => return Ok(Vec::new()),
        Some(DevicesValue::Text(t)) => parse_device_list(t),
        Some(DevicesValue::List(items)) => items
            .iter()
            .map(|d| match d {
                DeviceName::Index(i) if *i >= 0 => Ok(DeviceRequest::Cuda(*i as usize)),
                DeviceName::Index(i) => Err(format!("{i} is not a card index")),
                DeviceName::Name(n) => one(n),
            })
            .collect::<Result<Vec<_>, _>>()
            .and_then(checked),
    };
    list.map(|l| l.into_iter().map(device_name).collect())
        .map_err(|why| ctx.invalid("devices", why))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_to_one_rank_per_entry() {
        let l = parse_device_list("0, 1,cuda:3").unwrap();
        assert_eq!(
            l,
            vec![
                DeviceRequest::Cuda(0),
                DeviceRequest::Cuda(1),
                DeviceRequest::Cuda(3)
            ]
        );
        assert_eq!(
            parse_device_list("cpu,cpu").unwrap(),
            vec![DeviceRequest::Cpu; 2]
        );
        for (bad, why) in [
            ("", "no device"),
            ("0,0", "card 0 twice"),
            ("0,x", "\"x\" is not"),
        ] {
            let e = parse_device_list(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn train_json_takes_a_list_or_a_string() {
        let ctx = Ctx::new(std::path::Path::new("train.json"));
        let list: DevicesValue = serde_json::from_str(r#"[0, "cuda:2", "cpu"]"#).unwrap();
        assert_eq!(
            resolve_devices(Some(&list), &ctx).unwrap(),
            ["cuda:0", "cuda:2", "cpu"]
        );
        let text: DevicesValue = serde_json::from_str(r#""1,0""#).unwrap();
        assert_eq!(
            resolve_devices(Some(&text), &ctx).unwrap(),
            ["cuda:1", "cuda:0"]
        );
        let bad: DevicesValue = serde_json::from_str("[-1]").unwrap();
        let e = resolve_devices(Some(&bad), &ctx).unwrap_err().to_string();
        assert!(e.contains("devices") && e.contains("-1"), "{e}");
    }
}
