//! Published component configs of the real models, for benchmarks and tests that build the real
//! architectures with random weights (`Weights::random`). Each is the upstream `config.json`,
//! abridged to the keys that differ from diffusers'/transformers' defaults.

/// runwayml/stable-diffusion-v1-5 `unet/config.json`.
pub const SD15_UNET: &str = r#"{
  "_class_name": "UNet2DConditionModel", "act_fn": "silu",
  "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280],
  "center_input_sample": false, "cross_attention_dim": 768,
  "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
  "downsample_padding": 1, "flip_sin_to_cos": true, "freq_shift": 0, "in_channels": 4,
  "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32,
  "out_channels": 4, "sample_size": 64,
  "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]
}"#;

/// stabilityai/stable-diffusion-xl-base-1.0 `unet/config.json`.
pub const SDXL_UNET: &str = r#"{"addition_embed_type":"text_time","addition_time_embed_dim":256,
  "attention_head_dim":[5,10,20],"block_out_channels":[320,640,1280],"cross_attention_dim":2048,
  "down_block_types":["DownBlock2D","CrossAttnDownBlock2D","CrossAttnDownBlock2D"],
  "projection_class_embeddings_input_dim":2816,"sample_size":128,"transformer_layers_per_block":[1,2,10],
  "up_block_types":["CrossAttnUpBlock2D","CrossAttnUpBlock2D","UpBlock2D"],"use_linear_projection":true,
  "num_attention_heads":null,"class_embed_type":null,"upcast_attention":null}"#;

/// runwayml/stable-diffusion-v1-5 `text_encoder/config.json` (CLIP ViT-L/14 text).
pub const CLIP_L: &str = r#"{"hidden_act":"quick_gelu","hidden_size":768,"intermediate_size":3072,
  "max_position_embeddings":77,"num_attention_heads":12,"num_hidden_layers":12,
  "projection_dim":768,"vocab_size":49408,"bos_token_id":0,"eos_token_id":2,"pad_token_id":1}"#;

/// stabilityai/stable-diffusion-xl-base-1.0 `text_encoder_2/config.json` (OpenCLIP bigG text).
pub const CLIP_BIGG: &str = r#"{"hidden_act":"gelu","hidden_size":1280,"intermediate_size":5120,
  "max_position_embeddings":77,"num_attention_heads":20,"num_hidden_layers":32,
  "projection_dim":1280,"vocab_size":49408,"bos_token_id":0,"eos_token_id":2,"pad_token_id":1}"#;
