"""Models: the encoder, decoder blocks and the pre-training objectives."""
