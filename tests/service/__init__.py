"""The whole service as a real process: start-up, reliability, load, fuzzing, scale-out."""
