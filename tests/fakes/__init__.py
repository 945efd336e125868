"""Recording fakes of third-party packages aaccl drives, for tests without their hardware."""
