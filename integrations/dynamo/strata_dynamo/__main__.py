"""`python -m strata_dynamo`: a Dynamo worker over `strata serve` (docs/distributed.md)."""

from dynamo.common.backend.run import run

from .engine import StrataEngine


def main() -> None:
    run(StrataEngine)


if __name__ == "__main__":
    main()
