"""``python -m kombu_envelope.dispatcher --url envelope://...``."""

from kombu_envelope.dispatcher.server import main

raise SystemExit(main())
