//! Data parallel over NCCL on one card (world size 1; the `nccl` feature): the bindings, the
//! rendezvous that carries NCCL's id, the in-place sum and the CLI's multi-process path. Two
//! ranks cannot share one card in NCCL, so the sum of several ranks is proven by the CPU tests
//! (the same `reduce_step`, with the host sum in place of NCCL's).

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use sdtrain::dist::{DeviceSum, InProcess, Nccl};

/// A one-rank communicator sums a tensor into itself: the values come back unchanged, for a
/// tensor of its own and for a contiguous view at an offset (only that range is touched); a
/// bf16 or strided buffer is refused with the op's name.
#[test]
#[ignore = "needs a CUDA device and libnccl.so.2: scripts/gpu-check runs it (--include-ignored)"]
fn nccl_world_of_one_sums_in_place() {
    let dev = super::cuda("nccl_world_of_one_sums_in_place");
    let Device::Cuda(card) = &dev else {
        unreachable!()
    };
    let mut group = InProcess::group(1, Duration::from_secs(60));
    let mut coll = group.remove(0);
    let mut nccl = Nccl::join(&mut coll, card, Duration::from_secs(60)).unwrap();
    let t = Tensor::arange(0f32, 4099f32, &dev).unwrap();
    let before = t.to_vec1::<f32>().unwrap();
    nccl.sum_in_place(&t).unwrap();
    assert_eq!(t.to_vec1::<f32>().unwrap(), before);
    let big = Tensor::arange(0f32, 3000f32, &dev).unwrap();
    let view = big.narrow(0, 1000, 1000).unwrap();
    nccl.sum_in_place(&view).unwrap();
    assert_eq!(
        big.to_vec1::<f32>().unwrap(),
        (0..3000).map(|i| i as f32).collect::<Vec<_>>()
    );
    let e = nccl
        .sum_in_place(&t.to_dtype(DType::BF16).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("ncclAllReduce"), "{e}");
    let strided = Tensor::zeros((4, 4), DType::F32, &dev)
        .unwrap()
        .t()
        .unwrap();
    assert!(nccl.sum_in_place(&strided).is_err());
}

/// `sdtrain --config` as rank 0 of a world of 1 (the torchrun environment): the run joins the
/// TCP group and NCCL and sums its gradients through NCCL each step; its losses equal the plain
/// one-card run's.
#[test]
#[ignore = "needs a CUDA device and libnccl.so.2: scripts/gpu-check runs it (--include-ignored)"]
fn a_one_rank_nccl_run_tracks_the_plain_run() {
    super::cuda("a_one_rank_nccl_run_tracks_the_plain_run");
    let tmp = tempfile::tempdir().unwrap();
    let extra =
        serde_json::json!({ "mode": "lora", "adapter": { "rank": 4, "alpha": 4 }, "amp": "off" });
    let (plain, _) = super::train_losses(tmp.path(), "plain", extra.clone(), false);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let env = [
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("WORLD_SIZE", "1".into()),
        ("RANK", "0".into()),
        ("LOCAL_RANK", "0".into()),
    ];
    for (k, v) in &env {
        // The CUDA suite runs one test at a time (--test-threads=1).
        std::env::set_var(k, v);
    }
    let ranked = std::panic::catch_unwind(|| super::train_losses(tmp.path(), "nccl", extra, false));
    for (k, _) in &env {
        std::env::remove_var(k);
    }
    let (ranked, _) = ranked.unwrap();
    println!("plain {plain:?}\nnccl  {ranked:?}");
    assert_eq!(plain.len(), ranked.len());
    for (i, (a, b)) in plain.iter().zip(&ranked).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs().max(1e-6),
            "step {}: {a} plain vs {b} through NCCL",
            i + 1
        );
    }
}
