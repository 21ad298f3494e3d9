def pytest_configure(config):
    config.addinivalue_line("markers", "slow: lab checks that take more than a few seconds")
