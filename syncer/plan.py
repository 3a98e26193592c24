"""`python -m syncer.plan`, kept working after the planner moved: use `yeto-plan` (`syncer.tools.plan_cli`)."""

if __name__ == "__main__":
    import sys

    from syncer.tools.plan_cli import main

    print("python -m syncer.plan is deprecated: run yeto-plan (python -m syncer.tools.plan_cli)", file=sys.stderr)
    sys.exit(main())
