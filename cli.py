"""The tensortape command line (filled in by the CLI issue)."""
import click


@click.group()
def main():
    """Record and study what flows through a PyTorch model."""
