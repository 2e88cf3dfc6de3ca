"""The draft chain, the method's lowest floor (DESIGN.md section 1): which MTP steps are valid at a
position (:mod:`.masks`: the chain stops at its first invalid step; step k's targets at t + k), how
a chain of drafts is verified (:mod:`.sampling`: rejection sampling and target-only verification,
one chain or B at once) and what decoding will measure (:mod:`.decode_exact`: the decode-exact
forecast from the acceptance given each realized token, with its bootstrap intervals). Torch and
numpy (and the losses' chain mask): training, speculative decoding, the metrics and the study share it.
"""
