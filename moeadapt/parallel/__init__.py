"""moeadapt.parallel"""
