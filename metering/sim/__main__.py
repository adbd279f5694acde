"""Serve the simulated upstream in the foreground: python -m metering.sim --port 9000."""

import argparse

import uvicorn

from metering.sim.app import SimSettings, create_sim_app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m metering.sim", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--delay-s", type=float, default=0.0, help="delay between stream chunks")
    parser.add_argument("--chunks", type=int, default=None, help="content chunks per stream")
    parser.add_argument(
        "--nim-pending-polls", type=int, default=0, help="202 answers before a NIM result"
    )
    args = parser.parse_args()
    settings = SimSettings(
        chunks=args.chunks, delay_s=args.delay_s, nim_pending_polls=args.nim_pending_polls
    )
    uvicorn.run(create_sim_app(settings), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
