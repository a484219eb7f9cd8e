"""Writers that read result records only: JSON lines, HTML, JUnit, Markdown, baseline diff."""
