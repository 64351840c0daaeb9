"""The tiny SFT "pretrained" base that the CPU recipes start RL from (`rl build-base`)."""
