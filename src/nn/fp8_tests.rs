//! Parity with torch's `float8_e4m3fn` (tests/fixtures/fp8_reference.py made the numbers), and the
//! CUDA kernels (src/nn/kernels/fp8.cu) under the host emulation against the host functions.
#![cfg(test)]

use super::*;
use candle_core::Device;
use serde_json::Value;

fn reference() -> Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/fp8_reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// A JSON number, `null` (NaN) or "inf"/"-inf" as f32.
fn f32_of(v: &Value) -> f32 {
    match v {
        Value::Null => f32::NAN,
        Value::String(s) if s == "inf" => f32::INFINITY,
        Value::String(s) if s == "-inf" => f32::NEG_INFINITY,
        v => v.as_f64().unwrap() as f32,
    }
}

fn list<T>(v: &Value, f: impl Fn(&Value) -> T) -> Vec<T> {
    v.as_array().unwrap().iter().map(f).collect()
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn decode_matches_torch_for_every_code() {
    let want = list(&reference()["decode"], f32_of);
    assert_eq!(want.len(), 256);
    for (c, w) in want.iter().enumerate() {
        assert!(
            same(decode(c as u8), *w),
            "code {c:#04x}: {} vs torch {w}",
            decode(c as u8)
        );
    }
}

#[test]
fn encode_matches_torch_on_ties_subnormals_and_the_range_edge() {
    let r = reference();
    let xs = list(&r["encode"]["x"], f32_of);
    let codes = list(&r["encode"]["codes"], |v| v.as_u64().unwrap() as u8);
    assert!(xs.len() > 500);
    for (x, c) in xs.iter().zip(&codes) {
        assert_eq!(encode(*x), *c, "encode({x:e})");
    }
}

#[test]
fn every_finite_code_encodes_back_to_itself() {
    for c in 0..=255u8 {
        if c & 0x7f != 0x7f {
            assert_eq!(encode(decode(c)), c, "code {c:#04x}");
        }
    }
}

/// One of the fixture's weights: its tensor on the CPU, and the reference entry.
fn fixture_weights() -> Vec<(Tensor, Value)> {
    let r = reference();
    list(&r["weights"], |w| {
        let shape = list(&w["shape"], |d| d.as_u64().unwrap() as usize);
        let bits = list(&w["weight_bits"], |b| b.as_i64().unwrap());
        let t = match w["dtype"].as_str().unwrap() {
            "float32" => {
                let v: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b as u32)).collect();
                Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
            }
            _ => {
                let v: Vec<half::bf16> = bits
                    .iter()
                    .map(|&b| half::bf16::from_bits(b as u16))
                    .collect();
                Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
            }
        };
        (t, w.clone())
    })
}

#[test]
fn quantize_and_dequantize_match_torch_bit_for_bit() {
    for (w, r) in fixture_weights() {
        let name = r["name"].as_str().unwrap();
        let (codes, scale) = quantize(&w, name).unwrap();
        assert_eq!(codes.dtype(), DType::U8);
        assert_eq!(codes.dims(), w.dims());
        let got: Vec<f32> = scale.to_vec1().unwrap();
        let want = list(&r["scale"], f32_of);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!(same(*g, *w), "{name}: scale {g} vs torch {w}");
        }
        let got: Vec<u8> = codes.flatten_all().unwrap().to_vec1().unwrap();
        let want = list(&r["codes"], |v| v.as_u64().unwrap() as u8);
        assert_eq!(got, want, "{name}: codes");
        let deq = &r["dequantised"];
        let f: Vec<f32> = dequantize(&codes, &scale, DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (i, (g, w)) in f.iter().zip(list(&deq["float32"], f32_of)).enumerate() {
            assert!(same(*g, w), "{name}[{i}]: f32 {g} vs torch {w}");
        }
        for (dtype, key) in [(DType::BF16, "bfloat16"), (DType::F16, "float16")] {
            let t = dequantize(&codes, &scale, dtype).unwrap();
            assert_eq!(t.dtype(), dtype);
            let bits: Vec<u16> = match dtype {
                DType::BF16 => t
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<half::bf16>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
                _ => t
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<half::f16>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
            };
            let want = list(&deq[key], |v| v.as_u64().unwrap() as u16);
            assert_eq!(bits, want, "{name}: {key}");
        }
    }
}

#[test]
fn a_weight_with_a_nan_or_an_infinity_is_refused_with_its_name_and_row() {
    for bad in [f32::NAN, f32::INFINITY] {
        let mut v = vec![0.5f32; 12];
        v[7] = bad;
        let w = Tensor::from_vec(v, (3, 4), &Device::Cpu).unwrap();
        let e = quantize(&w, "mid_block.attn.to_q.weight")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("mid_block.attn.to_q.weight") && e.contains("output channel 1"),
            "{e}"
        );
    }
}

#[test]
fn a_vector_is_refused() {
    let w = Tensor::ones(5, DType::F32, &Device::Cpu).unwrap();
    assert!(quantize(&w, "b").is_err());
}

/// The kernels under the host emulation, with grids small enough that every grid-stride loop goes
/// round: row scales (a NaN row and an infinite row included), encoding of the awkward values and
/// the fixture weights, decoding of every code into each dtype.
#[test]
fn the_cuda_kernels_match_the_host_bit_for_bit() {
    use crate::kernel_emu::{launch, Arg};
    const CU: &str = "src/nn/kernels/fp8.cu";
    // Row scales: 7 rows of 45 over 2 warps and 1 block.
    let (rows, cols) = (7usize, 45usize);
    let mut w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.6 * (1.0 + (i % 5) as f32))
        .collect();
    w[2 * cols + 5] = f32::NAN;
    w[4 * cols + 44] = f32::NEG_INFINITY;
    w[5 * cols..6 * cols].fill(0.0);
    let mut scale = vec![0f32; rows];
    let mut args = vec![
        Arg::out(&mut scale),
        Arg::input(&w),
        Arg::Int(rows as i64),
        Arg::Int(cols as i64),
    ];
    launch(CU, "fp8_row_scale_f32", [1, 1, 1], [64, 1, 1], &mut args);
    for (r, s) in scale.iter().enumerate() {
        let want = row_scale(&w[r * cols..(r + 1) * cols]);
        assert!(same(*s, want), "row {r}: {s} vs {want}");
    }
    // Encoding: the awkward values as one row of scale 1.
    let xs = list(&reference()["encode"]["x"], f32_of);
    let mut codes = vec![0u8; xs.len()];
    let one = [1.0f32];
    let mut args = vec![
        Arg::out(&mut codes),
        Arg::input(&xs),
        Arg::input(&one),
        Arg::Int(xs.len() as i64),
        Arg::Int(xs.len() as i64),
    ];
    launch(CU, "fp8_encode_f32", [2, 1, 1], [32, 1, 1], &mut args);
    for (x, c) in xs.iter().zip(&codes) {
        assert_eq!(*c, encode(*x), "encode({x:e})");
    }
    // The fixture's bf16 conv weight: row scales and codes as the host's.
    let (conv, _) = fixture_weights().pop().unwrap();
    let (host_codes, host_scale) = quantize(&conv, "conv").unwrap();
    let wv: Vec<half::bf16> = conv.flatten_all().unwrap().to_vec1().unwrap();
    let (rows, cols) = (conv.dims()[0], wv.len() / conv.dims()[0]);
    let mut scale = vec![0f32; rows];
    let mut args = vec![
        Arg::out(&mut scale),
        Arg::input(&wv),
        Arg::Int(rows as i64),
        Arg::Int(cols as i64),
    ];
    launch(CU, "fp8_row_scale_bf16", [1, 1, 1], [32, 1, 1], &mut args);
    assert_eq!(scale, host_scale.to_vec1::<f32>().unwrap());
    let mut codes = vec![0u8; wv.len()];
    let mut args = vec![
        Arg::out(&mut codes),
        Arg::input(&wv),
        Arg::input(&scale),
        Arg::Int(wv.len() as i64),
        Arg::Int(cols as i64),
    ];
    launch(CU, "fp8_encode_bf16", [1, 1, 1], [32, 1, 1], &mut args);
    let want: Vec<u8> = host_codes.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(codes, want);
    // Decoding every code, 4 rows of 64 with different scales, into each dtype.
    let all: Vec<u8> = (0..=255).collect();
    let scales = [1.0f32, 0.003, 7.5, 1e-6];
    let codes_t = Tensor::from_vec(all.clone(), (4, 64), &Device::Cpu).unwrap();
    let scale_t = Tensor::from_vec(scales.to_vec(), 4, &Device::Cpu).unwrap();
    for (dtype, entry) in [
        (DType::F32, "fp8_decode_f32"),
        (DType::BF16, "fp8_decode_bf16"),
        (DType::F16, "fp8_decode_f16"),
    ] {
        let host = dequantize(&codes_t, &scale_t, dtype).unwrap();
        let host = host.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
        let host: Vec<f32> = host.to_vec1().unwrap();
        let mut out32 = vec![0f32; 256];
        let mut out16 = vec![0u16; 256];
        let out = match dtype {
            DType::F32 => Arg::out(&mut out32),
            _ => Arg::out(&mut out16),
        };
        let mut args = vec![
            out,
            Arg::input(&all),
            Arg::input(&scales),
            Arg::Int(256),
            Arg::Int(64),
        ];
        launch(CU, entry, [3, 1, 1], [32, 1, 1], &mut args);
        for i in 0..256 {
            let got = match dtype {
                DType::F32 => out32[i],
                DType::BF16 => half::bf16::from_bits(out16[i]).to_f32(),
                _ => half::f16::from_bits(out16[i]).to_f32(),
            };
            assert!(same(got, host[i]), "{entry}[{i}]: {got} vs {}", host[i]);
        }
    }
}
