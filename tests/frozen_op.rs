//! The frozen linear/conv ops against candle's ordinary ops (`*_reference`): same forward, same
//! input gradient, and no gradient for the frozen weight or bias.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{fill as randn, max_abs_diff};
use sdtrain::model::weights::Weights;
use sdtrain::nn::{
    frozen_conv2d, frozen_conv2d_bias, frozen_conv2d_reference, frozen_conv2d_stored,
    frozen_linear, frozen_linear_reference, frozen_linear_stored, frozen_matmul,
    frozen_matmul_reference, BaseWeight, Conv2d, Conv2dConfig, Linear,
};

/// Forward and `∂L/∂x` of `f` for `L = sum(f(x) * r)`, with `x` a Var.
fn fwd_grad(x: &Tensor, r: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let xv = Var::from_tensor(x).unwrap();
    let y = f(xv.as_tensor());
    let loss = (&y * r).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    (y, grads.get(xv.as_tensor()).unwrap().clone())
}

#[test]
fn frozen_linear_matches_reference() {
    let x = randn(&[6, 5], 1);
    let w = randn(&[7, 5], 2);
    let b = randn(&[7], 3);
    let r = randn(&[6, 7], 4);
    for bias in [None, Some(&b)] {
        let (y, gx) = fwd_grad(&x, &r, |x| frozen_linear(x, &w, bias).unwrap());
        let (y_ref, gx_ref) = fwd_grad(&x, &r, |x| frozen_linear_reference(x, &w, bias).unwrap());
        assert!(max_abs_diff(&y, &y_ref) < 1e-5);
        assert!(max_abs_diff(&gx, &gx_ref) < 1e-5);
    }
    let (y, gx) = fwd_grad(&x, &r, |x| frozen_matmul(x, &w).unwrap());
    let (y_ref, gx_ref) = fwd_grad(&x, &r, |x| frozen_matmul_reference(x, &w).unwrap());
    assert!(max_abs_diff(&y, &y_ref) < 1e-5);
    assert!(max_abs_diff(&gx, &gx_ref) < 1e-5);
}

#[test]
fn frozen_linear_accepts_a_strided_input() {
    let x = randn(&[5, 6], 5).t().unwrap();
    let w = randn(&[3, 5], 6);
    let y = frozen_matmul(&x, &w).unwrap();
    let y_ref = frozen_matmul_reference(&x, &w).unwrap();
    assert!(max_abs_diff(&y, &y_ref) < 1e-5);
}

#[test]
fn frozen_conv_matches_reference() {
    let x = randn(&[2, 3, 9, 9], 7);
    let b = randn(&[4], 8);
    for (k, padding, stride) in [(3, 1, 1), (3, 1, 2), (1, 0, 1), (3, 0, 2)] {
        let w = randn(&[4, 3, k, k], 9 + k as u64);
        let probe = frozen_conv2d_reference(&x, &w, None, padding, stride).unwrap();
        let r = randn(probe.dims(), 10);
        for bias in [None, Some(&b)] {
            let (y, gx) = fwd_grad(&x, &r, |x| {
                frozen_conv2d_bias(x, &w, bias, padding, stride).unwrap()
            });
            let (y_ref, gx_ref) = fwd_grad(&x, &r, |x| {
                frozen_conv2d_reference(x, &w, bias, padding, stride).unwrap()
            });
            assert!(max_abs_diff(&y, &y_ref) < 1e-5, "k{k} p{padding} s{stride}");
            assert!(
                max_abs_diff(&gx, &gx_ref) < 1e-5,
                "k{k} p{padding} s{stride}"
            );
        }
        let y = frozen_conv2d(&x, &w, padding, stride).unwrap();
        assert!(max_abs_diff(&y, &probe) < 1e-5);
    }
}

/// Candle's own conv backward fails on inputs whose H and W differ in parity at a strided conv,
/// so there the input gradient is checked by the adjoint identity of a linear map:
/// `⟨∂L/∂x, v⟩ = ⟨conv(v), r⟩` for `L = ⟨conv(x), r⟩` and any `v`.
#[test]
fn frozen_conv_input_gradient_on_non_square_input() {
    let x = randn(&[2, 3, 9, 8], 12);
    for (k, padding, stride) in [(3, 1, 2), (3, 1, 1), (3, 0, 2)] {
        let w = randn(&[4, 3, k, k], 13);
        let y = frozen_conv2d(&x, &w, padding, stride).unwrap();
        assert!(
            max_abs_diff(
                &y,
                &frozen_conv2d_reference(&x, &w, None, padding, stride).unwrap()
            ) < 1e-5
        );
        let r = randn(y.dims(), 14);
        let (_, gx) = fwd_grad(&x, &r, |x| frozen_conv2d(x, &w, padding, stride).unwrap());
        assert_eq!(gx.dims(), x.dims());
        for seed in [15, 16] {
            let v = randn(x.dims(), seed);
            let lhs = (&gx * &v)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let cv = frozen_conv2d_reference(&v, &w, None, padding, stride).unwrap();
            let rhs = (&cv * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                (lhs - rhs).abs() <= 1e-4 * rhs.abs().max(1.0),
                "k{k} s{stride}: {lhs} vs {rhs}"
            );
        }
    }
}

/// After backward through a frozen Linear and Conv2d (plain-tensor weights), the GradStore holds
/// the input Var's gradient and nothing else: no weight, no bias, no broadcast bias view.
#[test]
fn frozen_layers_store_no_weight_gradients() {
    let w = Weights::random(0, "t", DType::F32, &Device::Cpu, false);
    let conv = Conv2d::new(&w.pp("conv"), 3, 4, Conv2dConfig::same(3)).unwrap();
    let lin = Linear::new(&w.pp("lin"), 4, 5, true).unwrap();
    assert!(!conv.weight.is_variable() && !lin.weight.is_variable());
    let x = Var::from_tensor(&randn(&[1, 3, 4, 4], 11)).unwrap();
    let h = conv.forward(x.as_tensor()).unwrap();
    let h = h.permute((0, 2, 3, 1)).unwrap();
    let y = lin.forward(&h).unwrap();
    let loss = y.sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    for p in [&conv.weight, &lin.weight] {
        assert!(grads.get(p).is_none());
    }
    for b in [&conv.bias, &lin.bias] {
        assert!(grads.get(b.as_ref().unwrap()).is_none());
    }
    let ids: Vec<_> = grads.get_ids().collect();
    assert_eq!(
        ids,
        vec![&x.as_tensor().id()],
        "only the input Var has a gradient"
    );

    // The same layers, made trainable, still get weight gradients (the plain path).
    let wt = Weights::random(0, "t", DType::F32, &Device::Cpu, true);
    let conv_t = Conv2d::new(&wt.pp("conv"), 3, 4, Conv2dConfig::same(3)).unwrap();
    let y = conv_t.forward(x.as_tensor()).unwrap();
    let grads = y.sqr().unwrap().mean_all().unwrap().backward().unwrap();
    assert!(grads.get(&conv_t.weight).is_some());
    // And the frozen and trainable versions agree on the input gradient.
    let y_f = conv.forward(x.as_tensor()).unwrap();
    let g_f = y_f.sqr().unwrap().mean_all().unwrap().backward().unwrap();
    let diff = max_abs_diff(
        g_f.get(x.as_tensor()).unwrap(),
        grads.get(x.as_tensor()).unwrap(),
    );
    assert!(diff < 1e-6, "{diff}");
}

/// `frozen_broadcast_{add,mul}` match candle's broadcast ops in value and in `∂L/∂x`, and leave
/// no GradStore entry for the constant operand or its broadcast view.
#[test]
fn frozen_broadcast_ops_match_reference_and_store_only_the_input_gradient() {
    let x = randn(&[2, 3, 4], 20);
    let c = randn(&[3, 1], 21);
    let r = randn(&[2, 3, 4], 22);
    type Op = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;
    let cases: [(Op, Op); 2] = [
        (sdtrain::nn::frozen_broadcast_add, |x, c| x.broadcast_add(c)),
        (sdtrain::nn::frozen_broadcast_mul, |x, c| x.broadcast_mul(c)),
    ];
    for (frozen, reference) in cases {
        let (y, gx) = fwd_grad(&x, &r, |x| frozen(x, &c).unwrap());
        let (y_ref, gx_ref) = fwd_grad(&x, &r, |x| reference(x, &c).unwrap());
        assert!(max_abs_diff(&y, &y_ref) < 1e-6);
        assert!(max_abs_diff(&gx, &gx_ref) < 1e-6);
        let xv = Var::from_tensor(&x).unwrap();
        let loss = frozen(xv.as_tensor(), &c).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let ids: Vec<_> = grads.get_ids().collect();
        assert_eq!(ids, vec![&xv.as_tensor().id()]);
    }
}

/// `∂L/∂x` and the output of `f` for a bf16 `x` (a Var made from f32 values, cast in the graph)
/// with `L = sum(f(x) * r)` in f32.
fn fwd_grad_bf16(x: &Tensor, r: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let xv = Var::from_tensor(x).unwrap();
    let xb = xv.as_tensor().to_dtype(DType::BF16).unwrap();
    let y = f(&xb).to_dtype(DType::F32).unwrap();
    let grads = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
    (y, grads.get(xv.as_tensor()).unwrap().clone())
}

/// The CPU-bf16 frozen ops equal the plain upcast (f32 compute of the bf16 values, rounded once),
/// forward and input gradient, with and without a bias.
#[test]
fn cpu_bf16_frozen_layers_match_the_upcast_path() {
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let up = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let (x, w, b) = (
        randn(&[2, 3, 5], 11),
        bf(&randn(&[4, 5], 12)),
        bf(&randn(&[4], 13)),
    );
    let r = randn(&[2, 3, 4], 14);
    for bias in [None, Some(&b)] {
        let (y, gx) = fwd_grad_bf16(&x, &r, |x| {
            frozen_linear_stored(x, &BaseWeight::plain(&w), bias).unwrap()
        });
        let (y_ref, gx_ref) = fwd_grad_bf16(&x, &r, |x| {
            let y = frozen_linear_reference(
                &up(x).reshape((6, 5)).unwrap(),
                &up(&w),
                bias.map(up).as_ref(),
            )
            .unwrap();
            bf(&y.reshape((2, 3, 4)).unwrap())
        });
        assert!(max_abs_diff(&y, &y_ref) < 1e-2, "linear forward");
        assert!(max_abs_diff(&gx, &gx_ref) < 2e-2, "linear input gradient");
    }
    let x = randn(&[2, 3, 9, 8], 15);
    for (k, padding, stride) in [(3, 1, 1), (3, 1, 2), (1, 0, 1)] {
        let w = bf(&randn(&[4, 3, k, k], 16));
        let probe = frozen_conv2d_reference(&x, &up(&w), None, padding, stride).unwrap();
        let r = randn(probe.dims(), 17);
        for bias in [None, Some(&b)] {
            let (y, gx) = fwd_grad_bf16(&x, &r, |x| {
                frozen_conv2d_stored(x, &BaseWeight::plain(&w), bias, padding, stride).unwrap()
            });
            // The f32 frozen conv (tested against candle's above) handles the 9×8 input at
            // stride 2, where candle's own conv backward fails.
            let (y_ref, gx_ref) = fwd_grad_bf16(&x, &r, |x| {
                bf(
                    &frozen_conv2d_bias(&up(x), &up(&w), bias.map(up).as_ref(), padding, stride)
                        .unwrap(),
                )
            });
            let what = format!("conv k{k} p{padding} s{stride} bias {}", bias.is_some());
            assert!(max_abs_diff(&y, &y_ref) < 2e-2, "{what}: forward");
            assert!(max_abs_diff(&gx, &gx_ref) < 5e-2, "{what}: input gradient");
        }
    }
}
