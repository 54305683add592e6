"""What a user's media become before the encoders see them, in numpy: images resized and cut into patches, audio
turned into log-mel frames (or, for the unified 12B, waveform frames), and a prompt's placeholders expanded into
one token per soft token. Each follows transformers' Gemma 4 processors, checked against them by the tests."""
