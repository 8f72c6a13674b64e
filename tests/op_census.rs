//! The vendored candle-core's op census (feature `op-census`; `cargo test --features op-census
//! --test op_census`): kinds, bytes and call sites of a few known ops. Without the feature this
//! file is empty.
#![cfg(feature = "op-census")]

use candle_core::census::{self, Config};
use candle_core::{DType, Device, Tensor, Var};

fn start() {
    census::start(Config {
        crate_prefix: "op_census::".to_string(),
        source_prefix: "./tests/".to_string(),
        site_kinds: vec!["copy".into(), "to_dtype".into(), ":bcast".into()],
        depth: 1,
    });
}

fn calls(snap: &census::Snapshot, kind: &str) -> u64 {
    snap.ops
        .iter()
        .find(|(k, _)| k == kind)
        .map_or(0, |(_, c)| c.calls)
}

/// A transposed copy, a broadcast add, a cast and a plain add, counted by kind with their bytes,
/// the copy's site named by this file's line, and a backward copy named by its forward op. Catches
/// a broadcast tagged as strided (or not at all), bytes counted in the wrong dtype, and a site
/// taken from candle's own frames.
#[test]
fn counts_kinds_bytes_and_sites() {
    let dev = Device::Cpu;
    let x = Var::from_tensor(
        &Tensor::arange(0f32, 6.0, &dev)
            .unwrap()
            .reshape((2, 3))
            .unwrap(),
    )
    .unwrap();
    let b = Tensor::new(&[1f32, 2.0, 3.0], &dev).unwrap();
    start();
    let t = x.as_tensor().t().unwrap().contiguous().unwrap(); // [3, 2]
    let y = x.as_tensor().broadcast_add(&b).unwrap();
    let h = y.to_dtype(DType::BF16).unwrap();
    let z = (t.t().unwrap().contiguous().unwrap() + y).unwrap();
    let _ = z.sum_all().unwrap().backward().unwrap();
    census::stop();
    let snap = census::snapshot();
    assert_eq!(calls(&snap, "binary:add:bcast"), 1, "{:?}", snap.ops);
    assert_eq!(calls(&snap, "to_dtype:f32->bf16"), 1);
    assert!(calls(&snap, "copy_strided:strided") >= 2);
    let cast = snap
        .ops
        .iter()
        .find(|(k, _)| k == "to_dtype:f32->bf16")
        .unwrap();
    assert_eq!(cast.1.bytes, 6 * 2, "the cast writes 6 bf16 values");
    assert_eq!(h.dtype(), DType::BF16);
    let site = snap
        .sites
        .iter()
        .find(|s| s.kind == "copy_strided:strided" && s.backward_of.is_empty())
        .expect("a forward copy site");
    assert!(site.frames.contains("tests/op_census.rs:"), "{site:?}");
    assert!(
        snap.sites
            .iter()
            .any(|s| s.kind.starts_with("copy_strided") && s.backward_of == "Transpose"),
        "the backward of a transpose copies its gradient: {:?}",
        snap.sites
    );
}
