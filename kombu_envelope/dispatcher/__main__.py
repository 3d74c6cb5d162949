"""``python -m kombu_envelope.dispatcher --url envelope://...``."""

from kombu_envelope.dispatcher.server import main

if __name__ == "__main__":  # not when a tool walks the package's modules
    raise SystemExit(main())
