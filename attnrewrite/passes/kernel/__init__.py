"""The kernel family: attention out = phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j)), whose feature
maps each method computes (linear, hedgehog, favor; hydra and efficient use its pieces). Feature
maps are the methods'; these modules only contract them, each form with its torch reference
above its ONNX lowering:

- numerics.py: the guards every form shares (denominators, log scales, exponents);
- chunks.py: the chunk layout and the prefix sums and maxima over chunks, bounded in depth;
- state.py: the one causal chunk form, plain or with per-key log scales, after an optional
  state (KernelState) and returning the state after its keys (a decoder's prefill and steps);
- parallel.py: the bidirectional form, and the causal ones over a whole sequence: state.py's
  started from no state;
- naive.py: the N x N reference every form is tested against, in the chunk form's signature;
- delta.py, delta_onnx.py: the delta rule as the causal state's update (``update=delta``): its
  sequential reference and chunked WY form in torch, its standard-ops ONNX body, the parallel
  entry every kernel method shares under it, the pieces the recurrent entry calls;
- query_key_maps.py: calibration's learnable maps in front of a fixed feature map;
- feature_map.py: what a kernel method supplies (its FeatureMap: phi in torch and ONNX, log
  scales, feature count, the values calibration fits, which are its constants) and the
  parallel entries' flatten -> kernel -> reshape;
- random_features.py: FAVOR+'s seeded projection (orthogonal rows, chi or fixed lengths);
- recurrence.py: a method's recurrent form from its FeatureMap (KernelRecurrence), with the
  state (recurrent_state.py), the torch module (recurrent_torch.py) and the ONNX entry
  (recurrent_onnx.py).

The window hybrid (exact softmax nearby, a kernel beyond) is built on these in passes/window/.
"""
