//! Regression tests, named after what broke.

use candle_core::{Device, Tensor, Var};
use sdtrain::optim::{AdamW, AdamWParams, Optimizer};

/// A Var's gradient from candle's backward still tracks the ops that produced it. AdamW kept it
/// in its moments, chaining every step's forward graph into the state: the demo run grew by one
/// activation set (2.4 GB) per step until the OOM killer stopped it.
#[test]
fn adamw_moments_do_not_keep_the_forward_graph() {
    let w = Var::from_tensor(&Tensor::ones((4, 4), candle_core::DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    let x = Var::from_tensor(&Tensor::ones((2, 4), candle_core::DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    let loss = x
        .as_tensor()
        .matmul(w.as_tensor())
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    assert!(
        grads.get(&w).unwrap().track_op(),
        "candle changed: Var gradients are now detached"
    );
    let hyper = AdamWParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let mut opt = AdamW::group(vec![("w".into(), w.clone())], hyper).unwrap();
    opt.step(&grads).unwrap();
    let state = opt.state("w").unwrap();
    for (_, t) in state.tensors() {
        assert!(!t.track_op());
    }
    assert!(!w.as_tensor().detach().track_op());
}
